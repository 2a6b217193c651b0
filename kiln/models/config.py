"""ModelConfig: the architecture facts the model code needs, read from an HF `config.json` or from
GGUF metadata. Both the old (`rope_theta` + `rope_scaling`) and the transformers-5 style
(`rope_parameters`) config layouts are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.errors import ModelLoadError

# HF architectures the Llama-family code runs, and the knobs that distinguish them.
LLAMA_FAMILY = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}

# GGUF general.architecture -> HF architecture
GGUF_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    quantization: str | None = None  # e.g. "Q4_1" for a GGUF, from its file type

    @property
    def context_length(self) -> int:
        """The longest sequence kiln runs exactly: the position limit, or the sliding window
        where that is shorter (sliding-window attention is not implemented; within the window
        full attention is the same thing). The one rule the settings table, the startup caps
        and the runner read."""
        if self.sliding_window and self.sliding_window < self.max_position_embeddings:
            return self.sliding_window
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in LLAMA_FAMILY), None)
        if arch is None:
            raise ModelLoadError(
                f"architecture {archs or d.get('model_type')!r} is not supported by kiln's engine",
                hint=f"supported: {', '.join(LLAMA_FAMILY)}; or serve it with --engine vllm",
            )
        extra = LLAMA_FAMILY[arch]
        heads = d["num_attention_heads"]
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                            else None)
        if scaling is not None and "original_max_position_embeddings" not in scaling and \
                d.get("original_max_position_embeddings"):
            scaling = {**scaling,
                       "original_max_position_embeddings": d["original_max_position_embeddings"]}
        eos = d.get("eos_token_id")
        sliding = d.get("sliding_window") if d.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", extra.get("attention_bias", False))),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=bool(extra.get("qk_norm", False)),
            sliding_window=sliding,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            quantization=(d.get("quantization_config") or {}).get("quant_method"),
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        arch_name = meta.get("general.architecture")
        arch = GGUF_ARCH.get(str(arch_name))
        if arch is None:
            raise ModelLoadError(
                f"GGUF architecture {arch_name!r} is not supported by kiln's engine",
                hint=f"supported: {', '.join(GGUF_ARCH)}",
            )

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch_name}.{key}", default)

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
        scaling = None
        stype = get("rope.scaling.type")
        if stype and stype != "none":
            scaling = {"rope_type": stype, "factor": get("rope.scaling.factor", 1.0)}
            if get("rope.scaling.original_context_length"):
                scaling["original_max_position_embeddings"] = get(
                    "rope.scaling.original_context_length")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length") or hidden // heads),
            max_position_embeddings=int(get("context_length", 4096)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(eos)] if eos is not None else [],
        )

    def kv_bytes_per_token(self, bytes_per_elem: float) -> float:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * \
            bytes_per_elem
