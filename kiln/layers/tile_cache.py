"""A GGUF's MoE experts, repacked into kiln's int4 tiles once and mapped on every later start.

Packing a Q4_0/Q4_1 GGUF's experts into the tiles moe_q4 reads (ops.pack_q4_blocks) is one pass
over the file's bytes, but into fresh memory: 8.6 GB on a 14 B MoE model, and on a VM that backs
a guest's fresh pages lazily (the 2-core development machines) 2.5-5 s a GB past the first few.
The tiles are a function of the file's bytes and kiln's layout alone, so after the first start
each MoE layer's stack (w13 then w2, with the rows of an absorbed shared expert) is written to
kiln's cache folder, `tiles/<key>/layer<L>.bin`, and later starts map it instead of packing:
the page cache's pages, which the kernel keeps between runs.

The map is private (what the process writes never reaches the file) and advised for huge pages:
a file written in large pieces sits in the page cache as 2 MiB folios (ext4 and xfs on Linux
6.x), which such a map reads through 2 MiB page-table entries, as the anonymous huge pages
(engine/memory.py) the packed stacks would otherwise be moved to: decode reads the experts at
the same speed either way. A mapped stack is file memory, so `weights_on_huge_pages` leaves it.

The key covers the file (resolved path, size, modification time) and LAYOUT, which changes with
any change to the tiles' format. A layer file is written under a temporary name and renamed once
its bytes are on disk (fdatasync), from a background thread after the server is ready: a start
cut short leaves no file that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from kiln.paths import cache_dir

log = logging.getLogger("kiln.tiles")

LAYOUT = "q4-tiles-v3"  # q4_tiles.cpp's tile layout (reference.pack_q4); bump when it changes
MIN_LAYER_BYTES = 8 << 20  # smaller stacks pack in well under a second: not worth a file
_ALIGN = 2 << 20  # w2 starts on a 2 MiB boundary, so both stacks can sit on 2 MiB folios
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value (5.14+)
_SPARE_DISK = 1 << 30  # what writing the cache leaves free on its disk, at least


class TileCache:
    """One GGUF's folder of repacked expert stacks (see the module docstring)."""

    def __init__(self, folder: Path, source: dict) -> None:
        self.folder = folder
        self.source = source  # the file the tiles came from: path, size, mtime_ns, layout
        self.hits = 0  # layers mapped from the cache in this process
        self._writer: threading.Thread | None = None

    @classmethod
    def for_file(cls, path: str | Path) -> TileCache:
        p = Path(path).resolve()
        st = p.stat()
        source = {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                  "layout": LAYOUT}
        key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:20]
        return cls(cache_dir("tiles", key), source)

    def prefetch(self) -> None:
        """Asks the kernel to read every layer file the cache has into the page cache, from a
        daemon thread, while the model is built: where a start finds them evicted (another
        large model ran since), the disk reads overlap the load instead of each layer's map
        faulting its file in 2 MiB at a time (cold: 15.4 s to ready instead of 7.3 warm on the
        full-size model; the reads queued ahead bring that down)."""
        files = sorted(self.folder.glob("layer*.bin")) if self.folder.is_dir() else []
        if not files or not hasattr(os, "posix_fadvise"):
            return

        def read_ahead() -> None:
            for f in files:
                try:
                    fd = os.open(f, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass
                finally:
                    os.close(fd)

        threading.Thread(target=read_ahead, name="kiln-tile-prefetch", daemon=True).start()

    def _file(self, layer: int) -> Path:
        return self.folder / f"layer{layer}.bin"

    # ------------------------------------------------------------------ reading

    def load(self, layer: int, w13_shape: tuple[int, ...], w2_shape: tuple[int, ...]
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer`'s stacks (uint8 w13 [R, ...], w2 [R, ...] as `_quantize_stacked_q4`
        lays them out) mapped from the cache, or None where it has no complete file of that
        size (never written, another layout, a different model under the same name)."""
        n13, n2 = math.prod(w13_shape), math.prod(w2_shape)
        at2 = _aligned(n13)
        path = self._file(layer)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != at2 + n2:
                return None
            m = mmap.mmap(fd, at2 + n2, flags=mmap.MAP_PRIVATE,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)
        try:
            # Page tables filled now, from the page cache (reading the disk where it lost
            # them), not by the first requests: the full-size model's first 128-token
            # completions ran at 9-16 tok/s instead of 20 while they faulted the map in.
            m.madvise(_MADV_POPULATE_READ)
        except OSError:  # before Linux 5.14: the first steps fault the pages in
            pass
        # (the tensors keep the map alive: torch.frombuffer holds the buffer)
        w13 = torch.frombuffer(m, dtype=torch.uint8, count=n13).view(w13_shape)
        w2 = torch.frombuffer(m, dtype=torch.uint8, count=n2, offset=at2).view(w2_shape)
        self.hits += 1
        return w13, w2

    # ------------------------------------------------------------------ writing

    def save_in_background(self, stacks: Iterable[tuple[int, torch.Tensor, torch.Tensor]]
                           ) -> threading.Thread | None:
        """Writes each (layer, w13, w2) the cache lacks from a daemon thread (the server is
        ready meanwhile; os.pwrite lets go of the GIL). The stacks must not move afterwards
        (call it after weights_on_huge_pages). Returns the thread, or None with nothing to do
        or no room on the cache's disk."""
        todo = [(layer, w13, w2) for layer, w13, w2 in stacks
                if w13.nbytes + w2.nbytes >= MIN_LAYER_BYTES and not self._file(layer).exists()]
        if not todo:
            return None
        need = sum(_aligned(w13.nbytes) + w2.nbytes for _, w13, w2 in todo)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.folder).free
        except OSError as e:
            log.warning("tile cache: cannot use %s (%s); the next start repacks", self.folder, e)
            return None
        if free < need + _SPARE_DISK:
            log.warning("tile cache: %.1f GB free on %s's disk, %.1f GB needed (and 1 GB kept "
                        "free): not written; the next start repacks (--no-tile-cache stops "
                        "trying)", free / 1e9, self.folder, need / 1e9)
            return None
        _drop_stale(self.folder, self.source)
        _drop_unfinished(self.folder)
        (self.folder / "source.json").write_text(json.dumps(self.source, indent=1))
        self._writer = threading.Thread(target=self._write, args=(todo, need),
                                        name="kiln-tile-cache", daemon=True)
        self._writer.start()
        return self._writer

    def wait(self, timeout: float | None = None) -> None:
        """Until the background write is done (tests; a clean shutdown need not wait)."""
        if self._writer is not None:
            self._writer.join(timeout)

    def _write(self, todo: list[tuple[int, torch.Tensor, torch.Tensor]], need: int) -> None:
        t0 = time.monotonic()
        try:
            for layer, w13, w2 in todo:
                final = self._file(layer)
                tmp = final.with_suffix(f".tmp{os.getpid()}")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    _pwrite_all(fd, w13, 0)
                    _pwrite_all(fd, w2, _aligned(w13.nbytes))
                    os.fdatasync(fd)  # the bytes on disk before the name says they are there
                finally:
                    os.close(fd)
                os.replace(tmp, final)
        except OSError as e:
            log.warning("tile cache: writing %s failed (%s); the next start repacks",
                        self.folder, e)
            return
        log.info("tile cache: %d MoE layers' tiles (%.1f GB) written to %s in %.1f s; later "
                 "starts map them", len(todo), need / 1e9, self.folder, time.monotonic() - t0)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _pwrite_all(fd: int, t: torch.Tensor, offset: int) -> None:
    """A contiguous uint8 tensor's bytes at `offset`, in 64 MiB pieces (each a large folio's
    worth of page cache, and no copy of the tensor)."""
    view = memoryview(t.contiguous().reshape(-1).numpy())
    piece = 64 << 20
    for start in range(0, len(view), piece):
        chunk = view[start:start + piece]
        done = 0
        while done < len(chunk):
            done += os.pwrite(fd, chunk[done:], offset + start + done)


def _drop_stale(folder: Path, source: dict) -> None:
    """Removes the folders of earlier versions of the same file (same path, another size or
    time, or an older layout): a re-downloaded model does not leave its old tiles behind."""
    for other in folder.parent.iterdir():
        if other == folder or not other.is_dir():
            continue
        try:
            old = json.loads((other / "source.json").read_text())
        except (OSError, ValueError):
            continue
        if old.get("path") == source["path"]:
            shutil.rmtree(other, ignore_errors=True)


def _drop_unfinished(folder: Path) -> None:
    """Removes the temporary files of writers that died mid-write (layer<L>.tmp<pid>, its pid
    gone): a start killed while writing would otherwise leave gigabytes no start reads."""
    for tmp in folder.glob("layer*.tmp*"):
        pid = tmp.suffix[len(".tmp"):]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)
