"""The speculative-decoding settings before anything loads: vLLM's --speculative-config JSON
unpacked into the settings it names (each with that flag as its provenance), and a draft model
(--speculative-model) resolved like MODEL, so the dry run shows its path. startup.plan() calls
these."""

from __future__ import annotations

from typing import Any

from kiln.errors import ConfigError
from kiln.settings import table as C
from kiln.settings.resolve import ResolvedSettings

# vLLM's --speculative-config keys -> kiln's settings
_SPEC_CONFIG_KEYS = {"model": "speculative_model", "method": "speculative_method",
                     "num_speculative_tokens": "num_speculative_tokens",
                     "prompt_lookup_min": "ngram_prompt_lookup_min",
                     "prompt_lookup_max": "ngram_prompt_lookup_max",
                     "disable_by_batch_size": "speculative_disable_by_batch_size"}


def unpack_speculative_config(s: ResolvedSettings) -> None:
    """--speculative-config '{"model": ..., "num_speculative_tokens": K, "method": ...}'
    (vLLM's form) becomes the settings it names, each with this flag as its provenance."""
    r = s.values.get("speculative_config")
    if r is None or r.value is None:
        return
    for key, value in r.value.items():
        name = _SPEC_CONFIG_KEYS.get(key)
        if name is None:
            raise ConfigError(f"--speculative-config: unknown key {key!r}",
                              hint="keys: " + ", ".join(_SPEC_CONFIG_KEYS))
        if key == "method":
            value = {"draft_model": "draft"}.get(value, value)
        spec = C.setting(name)
        try:
            value = spec.parse(value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--speculative-config: {key} {value!r}: {e}") from None
        if spec.choices and value not in spec.choices:
            raise ConfigError(f"--speculative-config: method {value!r} is not one of "
                              f"{', '.join(spec.choices)} (or draft_model)")
        s.override(name, value, f"--speculative-config {key}", source=r.source)


def resolve_draft_model(s: ResolvedSettings, dirs: Any, *, offline: bool,
                         download: bool) -> None:
    """--speculative-model on kiln's engine: resolved like MODEL (alias, folder, GGUF, cached
    id; a missing one is the same error, with the pull command); the setting becomes the path,
    its reason what it was resolved from."""
    from kiln.resolve import sources

    r = s.values.get("speculative_model")
    if r is None or r.value is None:
        return
    src = sources.resolve_model(str(r.value), model_dirs=dirs, offline=offline,
                                download=download)
    path = str(src.gguf_file or src.path)
    if path != r.value:
        s.override("speculative_model", path,
                   f"{r.value} resolved ({src.origin}); {r.reason}".rstrip("; "),
                   source=r.source)


def resolve_draft_for_engine(s: ResolvedSettings, dirs: Any, *, offline: bool) -> None:
    """--speculative-model for vLLM / SGLang: a registry alias or local name means nothing to
    them, so it becomes what they load: the files when they are on this machine, else the
    registry's HF repo id (the engine downloads it). An HF id or a path passes as it is."""
    from pathlib import Path

    from kiln.errors import ModelNotFoundError
    from kiln.resolve import sources

    r = s.values.get("speculative_model")
    if r is None or r.value is None:
        return
    spec = str(r.value)
    entry = sources.registry_entry(spec)
    if entry is None and (Path(spec).expanduser().exists() or spec.count("/") == 1):
        return
    try:
        src = sources.resolve_model(spec, model_dirs=dirs, offline=offline, download=False,
                                    interactive=False)
        if src.format == "safetensors":
            value, how = str(src.path), src.origin
        elif entry is not None:  # a GGUF copy (SmolLM2's embedded one): the engines want HF
            value, how = entry.hf_repo, f"the {src.format} copy here is not for the engine"
        else:
            value, how = str(src.gguf_file or src.path), src.origin
    except ModelNotFoundError:
        if entry is None:
            raise
        value, how = entry.hf_repo, "not on this machine: the engine downloads it"
    if value != spec:
        s.override("speculative_model", value, f"{spec} resolved ({how}); {r.reason}",
                   source=r.source)
