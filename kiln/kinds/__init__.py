"""Model kinds: what a served model is for, and so which endpoints it answers.

    generate    chat / completions (a causal LM)             kiln's paged-KV engine
    embed       /v1/embeddings, /v1/rerank                   kiln/kinds/embedding.py
    transcribe  /v1/audio/transcriptions, translations       kiln/kinds/transcription.py
    speech      /v1/audio/speech                             kiln/kinds/speech.py

`--kind auto` reads the model's own files (`detect_kind`): a sentence-transformers folder
(modules.json with a Pooling module) or an encoder architecture (BertModel) is an embedding
model; a Whisper model (a CTranslate2 folder, or the HF architecture) is transcribe; a Piper voice
(.onnx + .onnx.json) is speech; anything else generates. The reason is kept with the value in the
effective config.

The audio kinds run in their own runtimes, not kiln's engine (why: kinds/transcription.py and
kinds/speech.py), installed by the `audio` extra and imported only when such a model is served.
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
    "transcribe": "/v1/audio/transcriptions, /v1/audio/translations",
    "speech": "/v1/audio/speech",
}

_ST_POOLING = "sentence_transformers.models.Pooling"
# ModelSource.format of the audio models (kiln's loader never opens them): a CTranslate2 Whisper
# folder, a Piper voice (.onnx + its .onnx.json).
AUDIO_FORMATS = ("ctranslate2", "piper")
AUDIO_EXTRA = "pip install 'kiln[audio]'"


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


def is_ct2_whisper(folder: Path) -> bool:
    """A Whisper model converted by CTranslate2 (faster-whisper's format): model.bin beside a
    config.json holding Whisper's decoding tables, not an HF config."""
    if not (folder / "model.bin").is_file():
        return False
    cfg = read_json(folder / "config.json")
    return isinstance(cfg, dict) and "suppress_ids" in cfg and "lang_ids" in cfg


def piper_voice(path: Path) -> Path | None:
    """The .onnx of a Piper voice: `path` itself (with its .onnx.json beside it), or the one
    such pair in a folder; None otherwise."""
    if path.is_file():
        ok = path.suffix == ".onnx" and path.with_name(path.name + ".json").is_file()
        return path if ok else None
    if path.is_dir():
        voices = [p for p in sorted(path.glob("*.onnx")) if p.with_name(p.name + ".json").is_file()]
        return voices[0] if len(voices) == 1 else None
    return None


def audio_format(path: Path) -> str | None:
    """"ctranslate2" / "piper" for an audio model kiln serves, None for anything else."""
    if path.is_dir() and is_ct2_whisper(path):
        return "ctranslate2"
    return "piper" if piper_voice(path) is not None else None


def import_audio(module: str) -> Any:
    """A module of the `audio` extra, or a one-line error saying how to install it."""
    import importlib

    from kiln.errors import KilnError

    try:
        return importlib.import_module(module)
    except ImportError as e:
        # One line, no hint block: the fix is the whole message.
        raise KilnError(f"serving audio models needs {e.name or module}: {AUDIO_EXTRA}") \
            from None


def detect_kind(path: Path | str | None, architecture: str | None) -> tuple[str, str]:
    """(kind, reason) from the model's files: its modules.json and config.json architecture,
    or an audio model's own files."""
    from kiln.models.config import ENCODER_ARCHITECTURES

    folder = Path(path) if path is not None else None
    fmt = audio_format(folder) if folder is not None else None
    if fmt == "ctranslate2":
        return "transcribe", ("a CTranslate2 Whisper model (model.bin, config.json with "
                              "Whisper's lang_ids / suppress_ids): speech-to-text")
    if fmt == "piper":
        return "speech", "a Piper voice (.onnx + .onnx.json): text-to-speech"
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
