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
    """Writes (once) and returns an HF folder with the GGUF's weights, config and tokenizer."""
    out = export_dir_for(gguf)
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=getattr(torch, dtype))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)  # atomic: a half-written export is never used
    return out
