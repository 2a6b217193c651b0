"""A GGUF as a Hugging Face folder, for external engines.

vLLM and SGLang load HF folders best (their GGUF paths want a tokenizer from the Hub, which is
not reachable offline). transformers can read a GGUF (dequantizing it) and write safetensors plus
the tokenizer and chat template, so kiln exports the folder once and caches it.
"""

from __future__ import annotations

import os
from pathlib import Path


def export_dir_for(gguf: Path) -> Path:
    base = Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")
    st = gguf.stat()
    return base / "hf-export" / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}"


def export_gguf_as_hf(gguf: Path, dtype: str = "bfloat16") -> Path:
    """Writes (once) and returns an HF folder with the GGUF's weights, config and tokenizer.

    Weights come from kiln's own GGUF reader (dequantized, Q/K rows un-permuted to the HF
    layout); the config and tokenizer from transformers' GGUF support.
    """
    out = export_dir_for(gguf)
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from kiln.models.loader import iter_tensors, open_checkpoint

    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the export is plain dense weights
    cfg.torch_dtype = dtype
    if not getattr(cfg, "architectures", None):
        # transformers' GGUF config names no architecture, and vLLM picks its model class from
        # that list: name the causal-LM class transformers maps this model type to.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.model_type)
        cfg.architectures = [arch] if arch else None
    cfg.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    target = getattr(torch, dtype)
    tensors = {name: t.to(target).contiguous() for name, t in iter_tensors(open_checkpoint(gguf))
               if name != "rope_freqs"}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out)  # atomic: a half-written export is never used
    return out
