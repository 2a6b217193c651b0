"""ModelConfig: the architecture facts the model code needs, read from an HF `config.json` or from
GGUF metadata. Both the old (`rope_theta` + `rope_scaling`) and the transformers-5 style
(`rope_parameters`) config layouts are accepted.

Mixture-of-experts and multi-head latent attention (MLA) facts live here too, under the HF names
(`num_experts`, `moe_intermediate_size`, `kv_lora_rank`, ...): a dense model leaves them at 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.errors import ModelLoadError
from kiln.i18n import msg

# HF architectures kiln's engine runs, and the knobs that distinguish them.
ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "Qwen2MoeForCausalLM": {"attention_bias": True, "shared_expert_gate": True},
    "Qwen3MoeForCausalLM": {"qk_norm": True},
    "MixtralForCausalLM": {"norm_topk_prob": True},  # softmax over the selected logits
    "DeepseekV2ForCausalLM": {},
    "DeepseekV3ForCausalLM": {},
    # Dense families beyond Llama: the switches their model code reads (see the fields below).
    "Gemma2ForCausalLM": {"norm_layout": "sandwich", "norm_offset": True,
                          "hidden_act": "gelu_pytorch_tanh", "scale_embeddings": True},
    "Gemma3ForCausalLM": {"norm_layout": "sandwich", "norm_offset": True, "qk_norm": True,
                          "hidden_act": "gelu_pytorch_tanh", "scale_embeddings": True},
    "Phi3ForCausalLM": {},
    "GraniteForCausalLM": {},
    "Olmo2ForCausalLM": {"norm_layout": "post", "qk_norm": True, "qk_norm_full": True},
    # Encoders: they serve embeddings only (--kind embed, kiln/kinds/embedding.py).
    "BertModel": {"encoder": True},
    # RoBERTa's layout is BERT's; positions start after the padding id (bge-m3, e5: XLM-R).
    "RobertaModel": {"encoder": True},
    "XLMRobertaModel": {"encoder": True},
}
# Architectures without a causal LM head: what `--kind auto` serves as embedding models.
ENCODER_ARCHITECTURES = frozenset(a for a, x in ARCHITECTURES.items() if x.get("encoder"))

# GGUF general.architecture -> HF architecture. llama.cpp writes Mixtral as "llama" with experts,
# and DeepSeek-V2 and V3 both as "deepseek2" (V3 is told apart by its sigmoid gating).
GGUF_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}
# Which layers of a GGUF slide when its metadata has no pattern: llama.cpp's fixed ones (every
# n-th layer global, the rest windowed).
GGUF_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
# Gemma 3's local (sliding-window) RoPE base where a GGUF does not say (llama.cpp's constant).
GEMMA3_LOCAL_THETA = 10000.0
# llama.cpp's `expert_gating_func` values
GGUF_GATING = {1: "softmax", 2: "sigmoid"}


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
    # Mixture of experts (num_experts == 0: a dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: none; DeepSeek: n_shared * moe_intermediate
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(gate(x)) scales the shared expert
    norm_topk_prob: bool = False  # renormalise the selected experts' weights to sum to 1
    scoring_func: str = "softmax"  # "softmax" | "sigmoid" (DeepSeek-V3)
    topk_method: str = "greedy"  # "greedy" | "group_limited_greedy" (V2) | "noaux_tc" (V3)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Which layers are MoE: the dense ones are listed (Qwen's mlp_only_layers, decoder_sparse_step,
    # DeepSeek's first_k_dense_replace and moe_layer_freq, all folded into one set).
    dense_layers: frozenset[int] = frozenset()
    # Multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank == 0: ordinary attention.
    q_lora_rank: int = 0  # 0: q_proj is one matrix (V2-Lite)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # RoPE over interleaved pairs (x0, x1), (x2, x3), ... instead of the two halves: DeepSeek's
    # checkpoints (HF `rope_interleave`, V2 always) and llama.cpp's deepseek2 lay the rope dims
    # out that way.
    rope_interleave: bool = False
    # Sliding-window attention: `sliding_window` keys back from each query (itself included),
    # in the layers `layer_types` marks "sliding_attention" (HF's list; None: every layer slides
    # when there is a window, as Mistral and Phi-3 do).
    layer_types: tuple[str, ...] | None = None
    # RoPE over the first `partial_rotary_factor` of each head (Phi-4-mini: 0.75).
    partial_rotary_factor: float = 1.0
    # Gemma 3: the sliding layers' own RoPE base (no scaling); None: one table for all layers.
    rope_local_theta: float | None = None
    # The dense families' switches (Llama's values by default).
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" | "gelu_pytorch_tanh"
    # "pre": x + attn(norm(x)) (Llama); "sandwich": x + norm(attn(norm(x))), the MLP alike
    # (Gemma 2/3); "post": x + norm(attn(x)) (OLMo 2).
    norm_layout: str = "pre"
    norm_offset: bool = False  # Gemma's RMSNorm: x * (1 + weight)
    qk_norm_full: bool = False  # OLMo 2: q/k RMSNorm over the whole projection, not per head
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the logits
    # Gemma multiplies embeddings by sqrt(hidden) (rounded to the embedding dtype first), Granite
    # by its embedding_multiplier (a Python float).
    scale_embeddings: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0  # Granite: x + f(x) * m
    logits_scaling: float = 1.0  # Granite: logits / s
    # Encoders (BERT): token type embeddings (0: none), the MLP's activation, the padding id.
    type_vocab_size: int = 0
    pad_token_id: int | None = None

    @property
    def is_encoder(self) -> bool:
        """A bidirectional encoder (BERT): no KV cache, no LM head; it only embeds."""
        return self.architecture in ENCODER_ARCHITECTURES

    @property
    def context_length(self) -> int:
        """The longest sequence kiln runs: the position limit (sliding-window layers attend
        within their window at any length). The one rule the settings table, the startup caps
        and the runner read."""
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to the whole context)."""
        if not self.sliding_window:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rotary_dim(self) -> int:
        """The dims RoPE rotates per head: MLA rotates only its `qk_rope_head_dim` part, a
        partial rotary factor its leading share."""
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @classmethod
    def from_hf(cls, d: dict[str, Any], *, require_supported: bool = True) -> ModelConfig:
        """`require_supported=False` reads any architecture's config.json (for an engine that
        is not kiln's: planning needs the shape and the experts, not kiln's model class)."""
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            if require_supported:
                raise ModelLoadError(
                    msg("model.arch_unsupported", arch=repr(archs or d.get("model_type"))),
                    hint=msg("model.arch_unsupported.hint", supported=", ".join(ARCHITECTURES)),
                )
            arch = str(archs[0] if archs else d.get("model_type") or "unknown")
        extra = ARCHITECTURES.get(arch, {})
        heads = d["num_attention_heads"]
        rope = dict(d.get("rope_parameters") or {})
        local_theta = None
        if "full_attention" in rope:  # per layer type (Gemma 3): the global table's parameters
            local_theta = float((rope.get("sliding_attention") or {}).get("rope_theta")
                                or GEMMA3_LOCAL_THETA)
            rope = dict(rope["full_attention"] or {})
        elif arch == "Gemma3ForCausalLM":
            local_theta = float(d.get("rope_local_base_freq") or GEMMA3_LOCAL_THETA)
        partial = float(rope.pop("partial_rotary_factor", None) or
                        d.get("partial_rotary_factor") or 1.0)
        theta = rope.pop("rope_theta", None) or d.get("rope_theta") or (
            1_000_000.0 if arch == "Gemma3ForCausalLM" else 10000.0)
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                            else None)
        if scaling is not None and "original_max_position_embeddings" not in scaling and \
                d.get("original_max_position_embeddings"):
            scaling = {**scaling,
                       "original_max_position_embeddings": d["original_max_position_embeddings"]}
        eos = d.get("eos_token_id")
        sliding = d.get("sliding_window") if d.get("use_sliding_window", True) else None
        layer_types = d.get("layer_types")
        pattern = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM":
                   int(d.get("sliding_window_pattern") or 6)}.get(arch)
        if layer_types is None and pattern:  # configs written before transformers' layer_types
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(int(d["num_hidden_layers"]))]
        qpas = d.get("query_pre_attn_scalar")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            # gpt-oss and MiniMax-M2 name the expert width intermediate_size; an MoE without
            # a dense MLP may leave it out.
            intermediate_size=d.get("intermediate_size") or 0,
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", d.get("layer_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", extra.get("attention_bias", False))),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=bool(extra.get("qk_norm", False)),
            sliding_window=sliding,
            layer_types=tuple(layer_types) if layer_types else None,
            partial_rotary_factor=partial,
            rope_local_theta=local_theta,
            hidden_act=str(d.get("hidden_activation") or d.get("hidden_act") or "silu"),
            norm_layout=extra.get("norm_layout", "pre"),
            norm_offset=bool(extra.get("norm_offset", False)),
            qk_norm_full=bool(extra.get("qk_norm_full", False)),
            attention_scale=(float(qpas) ** -0.5 if qpas else
                             float(d["attention_multiplier"]) if d.get("attention_multiplier")
                             else None),
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            scale_embeddings=bool(extra.get("scale_embeddings", False)),
            embedding_multiplier=float(d.get("embedding_multiplier") or 1.0),
            residual_multiplier=float(d.get("residual_multiplier") or 1.0),
            logits_scaling=float(d.get("logits_scaling") or 1.0),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            quantization=(d.get("quantization_config") or {}).get("quant_method"),
            type_vocab_size=int(d.get("type_vocab_size") or 0),
            pad_token_id=d.get("pad_token_id"),
            **_moe_from_hf(d, extra),
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        arch_name = meta.get("general.architecture")
        arch = GGUF_ARCH.get(str(arch_name))
        if arch is None:
            raise ModelLoadError(msg("model.gguf_arch_unsupported", arch=repr(arch_name)),
                                 hint=msg("model.supported", supported=", ".join(GGUF_ARCH)))

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch_name}.{key}", default)

        if arch == "LlamaForCausalLM" and get("expert_count"):
            arch = "MixtralForCausalLM"
        if arch == "DeepseekV2ForCausalLM" and GGUF_GATING.get(
                int(get("expert_gating_func", 0) or 0)) == "sigmoid":
            arch = "DeepseekV3ForCausalLM"

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
            if stype == "yarn" and get("rope.scaling.yarn_log_multiplier"):
                # deepseek2: llama.cpp stores 0.1 * mscale_all_dim. DeepSeek's published configs
                # have mscale == mscale_all_dim (V2 0.707, V3 1.0), which HF turns into
                # attention_factor 1 and a softmax scale of mscale(factor, mscale_all_dim)^2.
                m = float(get("rope.scaling.yarn_log_multiplier")) / 0.1
                scaling.update(mscale=m, mscale_all_dim=m)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        head_dim = int(get("attention.key_length") or hidden // heads)
        layers = int(get("block_count"))
        extra = ARCHITECTURES.get(arch, {})
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", 0) or 0),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            max_position_embeddings=int(get("context_length", 4096)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(eos)] if eos is not None else [],
            **_moe_from_gguf(get, arch, tensor_names),
            **_dense_from_gguf(get, str(arch_name), extra, hidden, heads, head_dim, layers),
        )

    def kv_bytes_per_token(self, bytes_per_elem: float) -> float:
        if self.is_mla:  # one latent row per token: the compressed KV plus the RoPE key
            return self.num_hidden_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * \
                bytes_per_elem
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * \
            bytes_per_elem


def _dense_from_gguf(get: Any, arch_name: str, extra: dict[str, Any], hidden: int, heads: int,
                     head_dim: int, layers: int) -> dict[str, Any]:
    """The dense families' switches from llama.cpp's metadata keys (Llama's values where a key
    is absent)."""
    out: dict[str, Any] = {k: extra[k] for k in ("norm_layout", "norm_offset", "qk_norm_full",
                                                 "hidden_act", "scale_embeddings") if k in extra}
    window = get("attention.sliding_window")
    if window:
        out["sliding_window"] = int(window)
        pattern = get("attention.sliding_window_pattern", GGUF_SWA_PATTERN.get(arch_name))
        if isinstance(pattern, list):  # per layer: true = sliding
            out["layer_types"] = tuple("sliding_attention" if p else "full_attention"
                                       for p in pattern)
        elif pattern:
            out["layer_types"] = tuple("sliding_attention" if (i + 1) % int(pattern)
                                       else "full_attention" for i in range(layers))
    rope_dims = get("rope.dimension_count")
    if rope_dims and int(rope_dims) < head_dim:
        out["partial_rotary_factor"] = int(rope_dims) / head_dim
    if arch_name == "gemma3":
        out["rope_local_theta"] = float(get("rope.freq_base_swa", GEMMA3_LOCAL_THETA))
    scale = get("attention.scale")
    if scale:
        out["attention_scale"] = float(scale)
    elif arch_name in GGUF_SWA_PATTERN and layers in (46, 62):
        # llama.cpp's rule for Gemma 2/3 27B (query_pre_attn_scalar = hidden / heads, not
        # head_dim), which its GGUFs do not store
        out["attention_scale"] = (hidden / heads) ** -0.5
    for key, field_name in (("attn_logit_softcapping", "attn_logit_softcapping"),
                            ("final_logit_softcapping", "final_logit_softcapping")):
        if get(key):
            out[field_name] = float(get(key))
    for key, field_name in (("embedding_scale", "embedding_multiplier"),
                            ("residual_scale", "residual_multiplier"),
                            ("logit_scale", "logits_scaling")):
        if get(key):
            out[field_name] = float(get(key))
    return out


def _moe_from_hf(d: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The MoE and MLA fields of an HF config (nothing for a dense model)."""
    out: dict[str, Any] = {}
    experts = next((int(d[k]) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if d.get(k)), 0)
    layers = int(d["num_hidden_layers"])
    if experts:
        deepseek = "n_routed_experts" in d
        if deepseek:
            first = int(d.get("first_k_dense_replace") or 0)
            freq = int(d.get("moe_layer_freq") or 1)
            dense = {i for i in range(layers) if i < first or i % freq}
            shared = int(d.get("n_shared_experts") or 0) * int(d["moe_intermediate_size"])
        else:
            step = int(d.get("decoder_sparse_step") or 1)
            dense = set(d.get("mlp_only_layers") or []) | {
                i for i in range(layers) if (i + 1) % step}
            shared = int(d.get("shared_expert_intermediate_size") or 0)
        method = d.get("topk_method") or ("noaux_tc" if arch_is_v3(d) else "greedy")
        out.update(
            num_experts=experts,
            # gpt-oss spells it experts_per_token
            num_experts_per_tok=int(d.get("num_experts_per_tok") or d.get("experts_per_token")
                                    or 2),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]),
            shared_expert_intermediate_size=shared,
            shared_expert_gate=bool(extra.get("shared_expert_gate", False)) and shared > 0,
            norm_topk_prob=bool(d.get("norm_topk_prob", extra.get("norm_topk_prob", False))),
            scoring_func=str(d.get("scoring_func") or
                             ("sigmoid" if arch_is_v3(d) else "softmax")),
            topk_method=str(method),
            n_group=int(d.get("n_group") or 1),
            topk_group=int(d.get("topk_group") or 1),
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            dense_layers=frozenset(dense),
        )
    if d.get("kv_lora_rank"):
        out.update(
            q_lora_rank=int(d.get("q_lora_rank") or 0),
            kv_lora_rank=int(d["kv_lora_rank"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]),
            rope_interleave=bool(d.get("rope_interleave", True)),
        )
    return out


def arch_is_v3(d: dict[str, Any]) -> bool:
    return "DeepseekV3ForCausalLM" in (d.get("architectures") or []) or \
        d.get("model_type") == "deepseek_v3"


def _moe_from_gguf(get: Any, arch: str, names: set[str]) -> dict[str, Any]:
    """The MoE and MLA fields from llama.cpp's metadata keys (nothing for a dense model)."""
    out: dict[str, Any] = {}
    experts = int(get("expert_count", 0) or 0)
    layers = int(get("block_count"))
    if experts:
        first = int(get("leading_dense_block_count", 0) or 0)
        dense = {i for i in range(layers) if i < first or f"blk.{i}.ffn_gate_inp.weight" not in names}
        shared_len = int(get("expert_shared_feed_forward_length", 0) or 0)
        expert_len = int(get("expert_feed_forward_length", 0) or 0)
        if arch.startswith("Deepseek"):
            shared_len = int(get("expert_shared_count", 0) or 0) * expert_len
        gating = GGUF_GATING.get(int(get("expert_gating_func", 0) or 0), "softmax")
        groups = int(get("expert_group_count", 0) or 0)
        out.update(
            num_experts=experts,
            num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=expert_len or int(get("feed_forward_length")),
            shared_expert_intermediate_size=shared_len,
            shared_expert_gate=any(n.endswith(".ffn_gate_inp_shexp.weight") for n in names),
            # llama.cpp always renormalises for Mixtral and Qwen3-MoE, never for Qwen2-MoE.
            norm_topk_prob=bool(get("expert_weights_norm", arch in (
                "MixtralForCausalLM", "Qwen3MoeForCausalLM"))),
            scoring_func=gating,
            topk_method=("noaux_tc" if gating == "sigmoid" and groups else
                         "group_limited_greedy" if groups > 1 else "greedy"),
            n_group=groups or 1,
            topk_group=int(get("expert_group_used_count", 0) or 0) or 1,
            routed_scaling_factor=float(get("expert_weights_scale", 1.0) or 1.0),
            dense_layers=frozenset(dense),
        )
    if get("attention.kv_lora_rank"):
        rope = int(get("rope.dimension_count"))
        out.update(
            q_lora_rank=int(get("attention.q_lora_rank", 0) or 0),
            kv_lora_rank=int(get("attention.kv_lora_rank")),
            qk_nope_head_dim=int(get("attention.key_length")) - rope,
            qk_rope_head_dim=rope,
            v_head_dim=int(get("attention.value_length")),
            rope_interleave=True,  # llama.cpp's deepseek2 rotates adjacent pairs (ROPE_TYPE_NORM)
        )
        # Newer converters write the MQA form (key_length = kv_lora_rank + rope, value_length =
        # kv_lora_rank, one KV head) and the per-head sizes under *_mla.
        if get("attention.key_length_mla"):
            out["qk_nope_head_dim"] = int(get("attention.key_length_mla")) - rope
        if get("attention.value_length_mla"):
            out["v_head_dim"] = int(get("attention.value_length_mla"))
    return out
