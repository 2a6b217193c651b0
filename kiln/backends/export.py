"""A GGUF as a Hugging Face folder, for external engines.

vLLM and SGLang load HF folders best (their GGUF paths want a tokenizer from the Hub, which is
not reachable offline), so kiln exports the folder once and caches it. The GGUF is read once, by
kiln's own reader (`kiln/models/gguf.py` through the loader): weights, config and tokenizer
metadata. transformers' GGUF path would parse the file again with `gguf.GGUFReader` (seconds on
the tokenizer's arrays).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.models.config import ModelConfig
    from kiln.models.loader import Checkpoint

from kiln.paths import cache_dir


def export_dir_for(gguf: Path) -> Path:
    st = gguf.stat()
    return cache_dir("hf-export", f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}")


def export_gguf_as_hf(gguf: Path, dtype: str = "bfloat16") -> Path:
    """Writes (once) and returns an HF folder with the GGUF's weights, config and tokenizer.

    Weights come from kiln's own GGUF reader (dequantized, Q/K rows un-permuted to the HF
    layout), the config from the same parse (`_hf_config`), and the tokenizer from kiln's cached
    GGUF tokenizer conversion (`kiln.tokenizer`), so the export and `kiln serve` tokenize alike.
    """
    out = export_dir_for(gguf)
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    import torch
    from safetensors.torch import save_file

    from kiln.models.loader import iter_tensors, open_checkpoint
    from kiln.tokenizer import _gguf_tokenizer

    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    ckpt = open_checkpoint(gguf)
    cfg = _hf_config(ckpt)
    cfg.torch_dtype = dtype
    if not getattr(cfg, "architectures", None):
        # transformers' GGUF config names no architecture, and vLLM picks its model class from
        # that list: name the causal-LM class transformers maps this model type to.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.model_type)
        cfg.architectures = [arch] if arch else None
    cfg.save_pretrained(tmp)
    _gguf_tokenizer(gguf).save_pretrained(tmp)
    target = getattr(torch, dtype)
    tensors = {name: t.to(target).contiguous() for name, t in iter_tensors(ckpt)
               if name != "rope_freqs"}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out)  # atomic: a half-written export is never used
    return out


def _hf_config(ckpt: Checkpoint) -> Any:
    """The transformers config of a GGUF checkpoint, built from the config kiln parsed (the same
    fields transformers' GGUF mapping sets, plus `architectures`, which vLLM reads). The GGUF
    architecture names kiln runs (llama, mistral, qwen2, qwen3) are transformers' model types."""
    from transformers import AutoConfig

    c, meta = ckpt.config, ckpt.gguf_meta or {}
    eos: int | list[int] | None = (c.eos_token_ids[0] if len(c.eos_token_ids) == 1
                                   else c.eos_token_ids or None)
    same_name = {k: getattr(c, k) for k in _HF_FIELDS}
    arch = str(meta["general.architecture"])
    return AutoConfig.for_model(
        _MODEL_TYPE.get(arch, arch), architectures=[c.architecture], eos_token_id=eos,
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        unk_token_id=meta.get("tokenizer.ggml.unknown_token_id"), **same_name,
        **_family_fields(c))


# GGUF architectures whose transformers model type is spelled otherwise.
_MODEL_TYPE = {"gemma3": "gemma3_text"}


def _family_fields(c: ModelConfig) -> dict[str, Any]:
    """The dense families' switches under transformers' names (ModelConfig's fields are kiln's),
    so the exported config describes the same model: windows, soft-caps, multipliers."""
    out: dict[str, Any] = {}
    if c.sliding_window:
        out["sliding_window"] = c.sliding_window
        if c.layer_types is not None:
            out["layer_types"] = list(c.layer_types)
    if c.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = c.partial_rotary_factor
    if c.architecture.startswith("Gemma"):
        scale = c.attention_scale or c.head_dim ** -0.5
        out.update(hidden_activation=c.hidden_act,
                   query_pre_attn_scalar=round(scale ** -2),  # an int; kiln keeps 1 / sqrt
                   attn_logit_softcapping=c.attn_logit_softcapping,
                   final_logit_softcapping=c.final_logit_softcapping)
        if c.rope_local_theta is not None:
            out["rope_local_base_freq"] = c.rope_local_theta
    if c.architecture == "GraniteForCausalLM":
        out.update(embedding_multiplier=c.embedding_multiplier,
                   residual_multiplier=c.residual_multiplier,
                   attention_multiplier=c.attention_scale or c.head_dim ** -0.5,
                   logits_scaling=c.logits_scaling)
    return out


# ModelConfig fields that transformers' configs spell the same way.
_HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
              "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias",
              "bos_token_id")
