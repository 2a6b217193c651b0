"""The Hugging Face hub cache, read directly from its documented layout
(models--owner--repo/{refs,snapshots,blobs}), so that HF_HUB_CACHE / HF_HOME set at run time
(tests, users) are respected and huggingface_hub is not imported to look."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from kiln.paths import xdg_cache_home


def hf_cache_dir() -> Path:
    """The hub cache huggingface_hub would use, read from the environment at call time."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return xdg_cache_home() / "huggingface" / "hub"


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


def cached_repos(cache: Path | None = None) -> Iterator[tuple[str, Path]]:
    root = cache or hf_cache_dir()
    if not root.is_dir():
        return
    for d in sorted(root.glob("models--*")):
        repo_id = d.name[len("models--") :].replace("--", "/", 1)
        snap = cached_snapshot(repo_id, root)
        if snap is not None:
            yield repo_id, snap
