"""A GGUF's weights as kiln repacked them, written once and mapped on every later start: its MoE
experts in kiln's int4 tiles, and the other weights as `weights_on_huge_pages` copied them.

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

The rest of the model's repacked weights (attention, dense MLPs, the head: what
`weights_on_huge_pages` would copy into fresh huge pages) go to one more file of the same folder,
`weights-<slots>.bin`, written after the first start and mapped at later ones where it holds the
same bytes as this start packed (compared before use): on a VM the fresh huge pages a copy
needs are the slowest memory there is (Qwen2.5-0.5B's 398 MB: 1.9-4.4 s to copy, 2-core Zen 3).

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
from typing import Any

import torch

from kiln.paths import cache_dir

log = logging.getLogger("kiln.tiles")

LAYOUT = "q4-tiles-v3"  # q4_tiles.cpp's tile layout (reference.pack_q4); bump when it changes
MIN_LAYER_BYTES = 8 << 20  # smaller stacks pack in well under a second: not worth a file
MIN_WEIGHTS_BYTES = 32 << 20  # the same for the other weights' copy to huge pages
_ALIGN = 2 << 20  # w2 starts on a 2 MiB boundary, so both stacks can sit on 2 MiB folios
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value (5.14+)
_SPARE_DISK = 1 << 30  # what writing the cache leaves free on its disk, at least


class TileCache:
    """One GGUF's folder of repacked expert stacks (see the module docstring)."""

    def __init__(self, folder: Path, source: dict) -> None:
        self.folder = folder
        self.source = source  # the file the tiles came from: path, size, mtime_ns, layout
        self.hits = 0  # layers mapped from the cache in this process
        self.weights_hit = False  # the other weights mapped from weights-<slots>.bin (set by
        # weights_on_huge_pages once their bytes compared equal)
        self._writers: list[threading.Thread] = []

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
        files = sorted(self.folder.glob("*.bin")) if self.folder.is_dir() else []
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

    def _weights_file(self, slots: list[int]) -> Path:
        # (the slots in the name: a model whose storages differ looks for another file)
        digest = hashlib.sha256(json.dumps(slots).encode()).hexdigest()[:12]
        return self.folder / f"weights-{digest}.bin"

    # ------------------------------------------------------------------ reading

    def load(self, layer: int, w13_shape: tuple[int, ...], w2_shape: tuple[int, ...]
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer`'s stacks (uint8 w13 [R, ...], w2 [R, ...] as `_quantize_stacked_q4`
        lays them out) mapped from the cache, or None where it has no complete file of that
        size (never written, another layout, a different model under the same name)."""
        n13, n2 = math.prod(w13_shape), math.prod(w2_shape)
        at2 = _aligned(n13)
        m = _map(self._file(layer), at2 + n2)
        if m is None:
            return None
        # (the tensors keep the map alive: torch.frombuffer holds the buffer)
        w13 = torch.frombuffer(m, dtype=torch.uint8, count=n13).view(w13_shape)
        w2 = torch.frombuffer(m, dtype=torch.uint8, count=n2, offset=at2).view(w2_shape)
        self.hits += 1
        return w13, w2

    def map_weights(self, slots: list[int]) -> mmap.mmap | None:
        """The weights file of storages of these (page-aligned) sizes, in this order, mapped
        as a layer's stacks are (private, huge pages) but not faulted in: the caller
        (weights_on_huge_pages) compares and faults it slot by slot, as it frees the copies it
        replaces. None where the cache has no such file."""
        if sum(slots) < MIN_WEIGHTS_BYTES:
            return None
        return _map(self._weights_file(slots), sum(slots), populate=False)

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
        if not self._make_room(need):
            return None
        return self._start(self._write, todo, need)

    def save_weights_in_background(self, pieces: list[tuple[torch.Tensor, int]],
                                   slots: list[int]) -> threading.Thread | None:
        """Writes the weights file of `slots` from a daemon thread: each piece (a storage's
        bytes, uint8) at its offset; the pieces must not change afterwards. A file of that
        name is replaced (weights_on_huge_pages calls this where there was none, or where its
        bytes differed from this start's)."""
        total = sum(slots)
        if total < MIN_WEIGHTS_BYTES or not self._make_room(total):
            return None
        return self._start(self._write_weights, pieces, slots)

    def _make_room(self, need: int) -> bool:
        """Whether `need` bytes may be written to the folder (made, its disk with room to
        spare, earlier versions and dead writers' pieces removed, source.json written)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.folder).free
        except OSError as e:
            log.warning("tile cache: cannot use %s (%s); the next start repacks", self.folder, e)
            return False
        if free < need + _SPARE_DISK:
            log.warning("tile cache: %.1f GB free on %s's disk, %.1f GB needed (and 1 GB kept "
                        "free): not written; the next start repacks (--no-tile-cache stops "
                        "trying)", free / 1e9, self.folder, need / 1e9)
            return False
        _drop_stale(self.folder, self.source)
        _drop_unfinished(self.folder)
        (self.folder / "source.json").write_text(json.dumps(self.source, indent=1))
        return True

    def _start(self, target: Any, *args: Any) -> threading.Thread:
        writer = threading.Thread(target=target, args=args, name="kiln-tile-cache", daemon=True)
        writer.start()
        self._writers.append(writer)
        return writer

    def wait(self, timeout: float | None = None) -> None:
        """Until the background write is done (tests; a clean shutdown need not wait)."""
        for writer in self._writers:
            writer.join(timeout)

    def _write(self, todo: list[tuple[int, torch.Tensor, torch.Tensor]], need: int) -> None:
        t0 = time.monotonic()
        try:
            for layer, w13, w2 in todo:
                _write_file(self._file(layer), [(w13, 0), (w2, _aligned(w13.nbytes))])
        except OSError as e:
            log.warning("tile cache: writing %s failed (%s); the next start repacks",
                        self.folder, e)
            return
        log.info("tile cache: %d MoE layers' tiles (%.1f GB) written to %s in %.1f s; later "
                 "starts map them", len(todo), need / 1e9, self.folder, time.monotonic() - t0)

    def _write_weights(self, pieces: list[tuple[torch.Tensor, int]], slots: list[int]) -> None:
        t0 = time.monotonic()
        final = self._weights_file(slots)
        try:
            _write_file(final, pieces)
        except OSError as e:
            log.warning("tile cache: writing %s failed (%s); the next start copies the "
                        "weights again", self.folder, e)
            return
        # One weights file a model: another is of other storages (another kiln, other
        # settings), which the next start with those writes again if it comes
        for other in self.folder.glob("weights-*.bin"):
            if other != final:
                other.unlink(missing_ok=True)
        log.info("tile cache: the other weights (%.2f GB) written to %s in %.1f s; later "
                 "starts map them", sum(slots) / 1e9, self.folder, time.monotonic() - t0)


def _write_file(final: Path, pieces: list[tuple[torch.Tensor, int]]) -> None:
    """Tensors' bytes at their offsets, under a temporary name renamed once they are on disk
    (fdatasync): a reader sees the whole file or none."""
    tmp = final.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite_aligned(fd, pieces)
        os.fdatasync(fd)  # the bytes on disk before the name says they are there
    finally:
        os.close(fd)
    os.replace(tmp, final)


def _pwrite_aligned(fd: int, pieces: list[tuple[torch.Tensor, int]]) -> None:
    """The pieces (contiguous tensors' bytes at their offsets) written as whole 2 MiB-aligned
    blocks, gaps zero: the page cache keeps what a write brings in as folios no larger than the
    write, so a file written storage by storage (the weights file: a 0.6 MB attention matrix,
    then 0.15 MB, ...) sat on small folios, which a map reads through 4 KiB page-table entries
    (Qwen3-MoE-shaped benchmark model: 40 of its weights file's 91 MB mapped on 2 MiB entries,
    the 35 MB of attention linears none). A block inside one piece is written from the piece
    (no copy: the experts' stacks); a block of several is gathered into a buffer first."""
    views = sorted(((o, memoryview(t.contiguous().reshape(-1).numpy())) for t, o in pieces),
                   key=lambda p: p[0])
    end = max((o + len(v) for o, v in views), default=0)
    buf = bytearray(_ALIGN)
    i = 0  # the first piece that may reach into the block
    for start in range(0, end, _ALIGN):
        stop = min(start + _ALIGN, end)
        while i < len(views) and views[i][0] + len(views[i][1]) <= start:
            i += 1
        inside = [(o, v) for o, v in views[i:] if o < stop]
        if len(inside) == 1 and inside[0][0] <= start and inside[0][0] + len(inside[0][1]) >= stop:
            o, v = inside[0]
            block = v[start - o:stop - o]
        else:
            buf[:stop - start] = bytes(stop - start)
            for o, v in inside:
                a, b = max(o, start), min(o + len(v), stop)
                buf[a - start:b - start] = v[a - o:b - o]
            block = memoryview(buf)[:stop - start]
        done = 0
        while done < len(block):
            done += os.pwrite(fd, block[done:], start + done)


def _map(path: Path, size: int, populate: bool = True) -> mmap.mmap | None:
    """`path` mapped private (what the process writes never reaches the file), advised for
    huge pages and (`populate`) faulted in, where it is a file of exactly `size` bytes; else
    None."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    if not populate:
        return m
    try:
        # Page tables filled now, from the page cache (reading the disk where it lost
        # them), not by the first requests: the full-size model's first 128-token
        # completions ran at 9-16 tok/s instead of 20 while they faulted the map in.
        m.madvise(MADV_POPULATE_READ)
    except OSError:  # before Linux 5.14: the first steps fault the pages in
        pass
    return m


def empty_on_huge_pages(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialized uint8 tensor on an anonymous map of its own, advised for 2 MiB pages:
    where MoE layers' stacks are packed when the cache has none (weights_on_huge_pages leaves
    them there). Packed into ordinary memory, they were copied onto huge pages after: every
    byte written twice, 24 s of the full-size model's 67 s first start on the Zen 3 VM, whose
    fresh memory is slow."""
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=torch.uint8)
    m = mmap.mmap(-1, n + _ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    off = (-torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()) % _ALIGN
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE, off, n)  # off: a multiple of the page size
    # (the tensor keeps the map alive: torch.frombuffer holds the buffer)
    return torch.frombuffer(m, dtype=torch.uint8, count=n, offset=off).view(shape)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _drop_stale(folder: Path, source: dict) -> None:
    """Removes the folders of earlier versions of the same file (same path, another size or
    time, or an older layout), and of files that are gone: a re-downloaded or deleted model
    does not leave its old tiles behind."""
    for other in folder.parent.iterdir():
        if other == folder or not other.is_dir():
            continue
        try:
            old = json.loads((other / "source.json").read_text())
        except (OSError, ValueError):
            continue
        if old.get("path") == source["path"] or not Path(str(old.get("path"))).exists():
            shutil.rmtree(other, ignore_errors=True)


def _drop_unfinished(folder: Path) -> None:
    """Removes the temporary files of writers that died mid-write (<name>.tmp<pid>, its pid
    gone): a start killed while writing would otherwise leave gigabytes no start reads."""
    for tmp in folder.glob("*.tmp*"):
        pid = tmp.suffix[len(".tmp"):]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)
