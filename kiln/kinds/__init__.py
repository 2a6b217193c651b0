"""Model kinds: what a served model is for, and so which endpoints it answers.

    generate    chat / completions (a causal LM)             kiln's paged-KV engine
    embed       /v1/embeddings, /v1/rerank                   kiln/kinds/embedding.py
    transcribe  /v1/audio/transcriptions                     not served by kiln's engine yet
    speech      /v1/audio/speech                             not served by kiln's engine yet

`--kind auto` reads the model's own files (`detect_kind`): a sentence-transformers folder
(modules.json with a Pooling module) or an encoder architecture (BertModel) is an embedding
model; Whisper-style speech-to-text is transcribe; anything else generates. The reason is kept
with the value in the effective config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

KINDS = ("generate", "embed", "transcribe", "speech")
# The endpoints each kind serves (what a refusal names).
ENDPOINTS = {
    "generate": "/v1/chat/completions, /v1/completions",
    "embed": "/v1/embeddings, /v1/rerank",
    "transcribe": "/v1/audio/transcriptions",
    "speech": "/v1/audio/speech",
}

_ST_POOLING = "sentence_transformers.models.Pooling"


def read_json(path: Path) -> Any:
    """A small JSON file of the model folder, or None when absent or unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def st_modules(folder: Path) -> list[dict[str, Any]]:
    """sentence-transformers' modules.json (Transformer -> Pooling -> [Dense] -> [Normalize]),
    [] for a folder without one."""
    mods = read_json(folder / "modules.json")
    return [m for m in mods if isinstance(m, dict)] if isinstance(mods, list) else []


def detect_kind(path: Path | str | None, architecture: str | None) -> tuple[str, str]:
    """(kind, reason) from the model's files: its modules.json and config.json architecture."""
    from kiln.models.config import ENCODER_ARCHITECTURES

    folder = Path(path) if path is not None else None
    if folder is not None and folder.is_dir():
        if any(m.get("type") == _ST_POOLING for m in st_modules(folder)):
            return "embed", "a sentence-transformers model (modules.json has a Pooling module)"
        if architecture is None:
            cfg = read_json(folder / "config.json") or {}
            archs = cfg.get("architectures") or []
            architecture = archs[0] if archs else None
    arch = architecture or ""
    if arch in ENCODER_ARCHITECTURES or arch.endswith(("RobertaModel", "BertModel")):
        return "embed", f"{arch} is an encoder (no LM head): it embeds"
    if arch.startswith("Whisper"):
        return "transcribe", f"{arch} is a speech-to-text model"
    if not arch:
        return "generate", ("generating is the default: no sentence-transformers files, no "
                            "encoder architecture")
    return "generate", f"{arch} is a causal LM"


def kind_of(path: Path | str | None, architecture: str | None,
            entry: Any = None) -> tuple[str, str]:
    """`detect_kind`, and where the files say only "generate", kiln's registry entry's
    `serves` (a repo whose sentence-transformers files were not fetched, a GGUF)."""
    found = detect_kind(path, architecture)
    serves = getattr(entry, "serves", "generate")
    if found[0] == "generate" and serves != "generate":
        return serves, f"kiln's registry entry {entry.name} serves {serves}"
    return found
