"""Memory planning for the model runner: how big the KV pool may be (weights + measured
activations + KV against the device's memory), the lazily backed CPU KV tensors, glibc malloc
tuning, and the process RSS readers the activation measurement uses.

Available RAM comes from the hardware probe (kiln/resolve/hardware.py), which honours cgroup
limits: inside a container /proc/meminfo describes the host, not what may OOM-kill us.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import hashlib
import itertools
import json
import logging
import math
import mmap
import os
import platform
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.errors import MemoryFitError
from kiln.i18n import msg
from kiln.layers.attention import INT8_SCALE_BYTES
from kiln.layers.tile_cache import MADV_POPULATE_READ
from kiln.models.config import ModelConfig
from kiln.paths import cache_dir
from kiln.resolve import hardware
from kiln.settings.engine_config import EngineConfig
from kiln.settings.rules import GiB

log = logging.getLogger("kiln.memory")

KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
             "int8": torch.int8}
# On CPU the KV pool is capped unless the user sizes it (--kv-cache-memory): at the larger of
# this and the weights' own size. A small model's KV cache need not outweigh the model many
# times (512 MiB is ~23k tokens of SmolLM2-135M in bf16, what llama-server's -c 32768 holds in
# f16), and a big model's cap grows with it, up to the RAM fraction.
CPU_KV_AUTO_CAP = 512 * 1024 * 1024


@dataclass
class MemoryPlan:
    num_blocks: int
    block_size: int
    block_bytes: int
    kv_bytes: int
    weight_bytes: int
    activation_bytes: int
    max_model_len: int
    reason: str
    warnings: list[str] = field(default_factory=list)

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size


def kv_bytes_per_token(mc: ModelConfig, kv_dtype_name: str) -> int:
    """KV bytes one token takes over all layers (K and V; int8 adds its per-head scales; MLA
    keeps one latent row per layer, see ModelConfig.kv_bytes_per_token)."""
    if mc.is_mla:
        if kv_dtype_name == "int8":  # engine/decisions.py never picks it for MLA
            raise ValueError("int8 KV is not supported for multi-head latent attention")
        return int(mc.kv_bytes_per_token(KV_DTYPES[kv_dtype_name].itemsize))
    per_head = mc.head_dim * KV_DTYPES[kv_dtype_name].itemsize
    if kv_dtype_name == "int8":
        per_head += INT8_SCALE_BYTES  # fp16 scale per (token, head)
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * per_head


# The activation peak of a configuration, measured once (a prefill of the whole token budget:
# 8 s of an 18 s start for Qwen2.5-1.5B on 2 cores) and kept under the cache folder.
PEAK_CACHE = "activation-peaks"


def activation_peak(key: dict[str, Any], device: torch.device,
                    forward: Callable[[], object]) -> tuple[int, str]:
    """(bytes, where the figure comes from): `measure_activation_peak`'s, or the one an earlier
    start with the same `key` measured (the model file, every engine setting, torch and kiln's
    own sources: anything that changes the step changes the key)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    path = cache_dir(PEAK_CACHE, f"{digest[:32]}.json")
    try:
        cached = int(json.loads(path.read_text())["activation_bytes"])
        return cached, f"measured at an earlier start with these settings ({path})"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    peak = measure_activation_peak(device, forward)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"activation_bytes": peak, "key": key}, default=str))
        os.replace(tmp, path)
    except OSError as e:  # an unwritable cache: measured again next time
        log.debug("activation peak not cached (%s)", e)
    return peak, "measured at startup (a prefill of the token budget)"


@functools.cache
def source_digest() -> str:
    """A digest of kiln's Python and C++ sources: a cached measurement is only reused by the
    code that made it."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted([*root.rglob("*.py"), *root.rglob("*.cpp")]):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def measure_activation_peak(device: torch.device, forward: Callable[[], object]) -> int:
    """Bytes `forward` (the largest step the scheduler may produce) needed above what was in use
    before it: CUDA's allocator peak on a GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = hardware.reset_rss_peak()
    forward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = hardware.rss_peak_bytes() - base
    return max(int(peak), 0)


def plan_memory(c: EngineConfig, device: torch.device, per_token: int, weight_bytes: int,
                activation_bytes: int, max_model_len: int,
                activation_source: str = "measured at startup") -> MemoryPlan:
    """Sizes the KV pool from --kv-cache-memory, else from the device's memory left after the
    weights and the activation peak; lowers an automatic max_model_len to what the pool holds
    (an explicit one that does not fit is refused)."""
    block_size = c.cache.block_size
    block_bytes = per_token * block_size
    act = activation_bytes
    warnings: list[str] = []
    if c.cache.kv_cache_memory:
        budget = c.cache.kv_cache_memory
        reason = f"--kv-cache-memory {gib(budget)}"
    elif device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        used_by_us = torch.cuda.memory_allocated(device)
        budget = int(total * c.cache.gpu_memory_utilization) - used_by_us - act
        reason = (f"KV pool {gib(budget)} = {c.cache.gpu_memory_utilization:.0%} of GPU memory "
                  f"{gib(total)} - weights {gib(used_by_us)} - activations {gib(act)}")
    else:
        avail = ram_available_bytes()
        frac = int(avail * c.cache.cpu_memory_utilization) - act
        need = c.scheduler.max_num_seqs * max_model_len * per_token
        cap = max(CPU_KV_AUTO_CAP, weight_bytes)
        budget = min(frac, need, cap)
        reason = (f"KV pool {gib(budget)} = min({c.cache.cpu_memory_utilization:.0%} of available "
                  f"RAM {gib(avail)} - activations {gib(act)}, {c.scheduler.max_num_seqs} full "
                  f"contexts {gib(need)}, CPU cap {gib(cap)} = max(0.50 GiB, weights))")
    num_blocks = max(budget // block_bytes, 0)
    if c.cache.kv_max_blocks:
        if c.cache.kv_max_blocks < num_blocks:
            reason += f"; capped at --kv-max-blocks {c.cache.kv_max_blocks}"
        num_blocks = min(num_blocks, c.cache.kv_max_blocks)
    fits = num_blocks * block_size
    max_len = max_model_len
    if fits < max_len:
        if c.max_model_len_explicit or fits < block_size:
            raise MemoryFitError(
                msg("memory.context_does_not_fit", max_len=max_len, fits=fits,
                    blocks=num_blocks, reason=reason),
                hint=msg("memory.context_does_not_fit.hint", fits=fits) if fits >= block_size
                else msg("memory.kv_too_small.hint"))
        warnings.append(msg("memory.context_lowered", max_len=max_len, fits=fits))
        max_len = fits
    if not c.cache.kv_cache_memory:
        reason += f"; activations {activation_source}"
    return MemoryPlan(int(num_blocks), block_size, int(block_bytes),
                      int(num_blocks * block_bytes), weight_bytes, act, max_len, reason, warnings)


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. On CPU it lives in its own anonymous mmap: the kernel hands out zero
    pages as they are first written, so the pool costs RSS for the blocks in use, not for its
    whole size up front (as llama.cpp's KV buffer does; torch.zeros would touch every page).
    The tensor, and every view of it, holds a reference to its map."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    buf = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


# Storages below this stay where they are (norm weights, biases: a few pages each).
HUGE_PAGE_MIN_BYTES = 64 << 10
_HUGE = 2 << 20
_TRIM_EVERY = 32 << 20  # weights_on_huge_pages gives the old copies back this often


def weights_on_huge_pages(model: torch.nn.Module, cache: Any = None,
                          apart: Collection[int] = ()) -> int:
    """Moves the model's CPU weights (parameters and buffers on storages of 64 KiB or more)
    into one anonymous map advised for transparent huge pages (madvise MADV_HUGEPAGE; the
    usual THP setting is `madvise`, so nothing else gets them). Why: a decode step streams
    every weight once, and on 4 KiB pages it walks a page table every 4 KiB of it (SmolLM2's
    66 MB of int4 layers: 16k walks a step, while the TLB holds ~8 MB): on 2 MiB pages the same
    kernels streamed 30 layers of SmolLM2-shaped q4 weights in 4.2 ms instead of 5.0 (2-core
    EPYC, Dec 5). Each storage is copied once, and every tensor on it is re-pointed at the copy
    with its own offset, shape and strides (tied weights stay tied); the old storage is freed
    as its last tensor moves. Returns the bytes moved (0 where THP is off or missing).

    `cache` (a kiln.layers.tile_cache.TileCache, or None): the same bytes as an earlier start
    wrote them (`weights-<slots>.bin`, page cache on 2 MiB folios), mapped instead of copied
    where they match this start's byte for byte; otherwise the copy, which the cache then
    writes from a background thread. Why: fresh huge pages are the memory a VM backs last, on their first
    touch: Qwen2.5-0.5B's 398 MB took 1.9-4.4 s to copy on the 2-core Zen 3 VM (Dec 7), where
    the page cache's folios are kept, and backed, between runs. `apart`: storages (data
    pointers) left where they are and out of the weights file: MoE layers' stacks, packed onto
    2 MiB pages already (tile_cache.empty_on_huge_pages) or the cache's maps of their layer
    files (the weights file's slots are then the same at a first start as at later ones: it had
    held a 7.8 GB copy of a 14 B model's experts beside their layer files, under a name no later
    start asked for)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or platform.system() != "Linux":
        return 0
    try:
        if "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
            return 0
    except OSError:
        return 0
    files = _file_maps()
    # storage -> the (table, name) slots of the tensors on it
    groups: dict[int, list[tuple[dict, str]]] = {}
    sizes: dict[int, int] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                # (strided tensors only: oneDNN's packed weights have no storage to move)
                if (t is None or t.device.type != "cpu" or t.layout != torch.strided
                        or t.is_mkldnn):
                    continue
                try:
                    st = t.untyped_storage()
                except (NotImplementedError, RuntimeError):
                    continue
                # Views of a mapped file (a GGUF's raw blocks, e.g. an embedding table that
                # only looks rows up) stay: their untouched pages cost no memory, a copy would.
                if (st.nbytes() >= HUGE_PAGE_MIN_BYTES and st.data_ptr() not in apart
                        and not _in_ranges(st.data_ptr(), files)):
                    groups.setdefault(st.data_ptr(), []).append((table, name))
                    sizes[st.data_ptr()] = st.nbytes()
    if not groups:
        return 0
    slot = {key: -(-n // 4096) * 4096 for key, n in sizes.items()}  # page-aligned slots
    slots = [slot[key] for key in groups]
    mapped = cache.map_weights(slots) if cache is not None else None
    todo = groups
    if mapped is not None:
        todo = _map_same(groups, sizes, slot, mapped)
        if not todo:
            cache.weights_hit = True
            return sum(sizes.values())
        log.info("tile cache %s holds other bytes for these weights (another kiln or model): "
                 "%d of %d storages copied anew", cache.folder, len(todo), len(groups))
    total = sum(slot[key] for key in todo)
    # private: a shared anonymous map is shmem, whose huge pages are another setting (off)
    buf = mmap.mmap(-1, total + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    off = (-ctypes.addressof(ctypes.c_char.from_buffer(buf))) % _HUGE
    buf.madvise(mmap.MADV_HUGEPAGE, off, total)  # off: a multiple of the page size
    unreturned = 0
    for key, on in todo.items():
        n = sizes[key]
        dst = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=off)
        dst.copy_(_bytes_of(on[0][0][on[0][1]], n))
        _repoint(on, dst)
        off += slot[key]
        unreturned += n
        if unreturned >= _TRIM_EVERY:
            # Loading's tensors came from the heap (glibc's mmap threshold had risen past
            # their size), where a freed one stays resident: without a trim every few
            # storages, all the old copies would be in RSS beside the new map at the end.
            release_freed_memory()
            unreturned = 0
    if cache is not None:  # every storage's bytes where they now are, at its slot's offset
        at = list(itertools.accumulate(slots, initial=0))[:-1]
        cache.save_weights_in_background(
            [(_bytes_of(on[0][0][on[0][1]], sizes[key]), o)
             for (key, on), o in zip(groups.items(), at, strict=True)], slots)
    return sum(sizes.values())  # (the caller trims what the last storages left)


def _bytes_of(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first n bytes of t's storage, as a uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), 0, (n,), (1,))


def _repoint(on: list[tuple[dict, str]], dst: torch.Tensor) -> None:
    """Every tensor of one storage (its (table, name) slots) re-pointed at dst's storage, each
    with its own offset, shape and strides; the old storage is freed with its last tensor."""
    for table, name in on:
        t = table[name]
        new = torch.empty(0, dtype=t.dtype).set_(dst.untyped_storage(), t.storage_offset(),
                                                 t.size(), t.stride())
        table[name] = (torch.nn.Parameter(new, requires_grad=t.requires_grad)
                       if isinstance(t, torch.nn.Parameter) else new)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two uint8 tensors of one length (each from its storage's start) hold the same
    bytes: compared 8 at a time (400 MB: 34 ms, against 209 ms a byte at a time)."""
    k = a.numel() - a.numel() % 8
    return (torch.equal(a[:k].view(torch.int64), b[:k].view(torch.int64))
            and torch.equal(a[k:], b[k:]))


def _map_same(groups: dict[int, list[tuple[dict, str]]], sizes: dict[int, int],
              slot: dict[int, int], mapped: mmap.mmap) -> dict[int, list[tuple[dict, str]]]:
    """weights_on_huge_pages from the cache's file (`mapped`, the storages' slots in order):
    storage by storage, while its bytes equal its slot's, its tensors are re-pointed there
    (each slot faulted in just before: the map grows as the old copies go). Returns the
    storages from the first that differs on (none: all mapped)."""
    off, unreturned = 0, 0
    keys = list(groups)
    for i, key in enumerate(keys):
        on, n = groups[key], sizes[key]
        with contextlib.suppress(OSError):  # (before Linux 5.14: the compare faults it in)
            mapped.madvise(MADV_POPULATE_READ, off, slot[key])
        # (its own storage from the slot's start: _repoint keeps each tensor's storage offset)
        view = torch.frombuffer(mapped, dtype=torch.uint8, count=n, offset=off)
        if not _same_bytes(view, _bytes_of(on[0][0][on[0][1]], n)):
            return {k: groups[k] for k in keys[i:]}
        _repoint(on, view)
        off += slot[key]
        unreturned += n
        if unreturned >= _TRIM_EVERY:  # (as the copy does)
            release_freed_memory()
            unreturned = 0
    return {}


def _file_maps() -> list[tuple[int, int]]:
    """The address ranges of this process's file-backed maps (/proc/self/maps), sorted."""
    out = []
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[4] != "0" and parts[5].startswith("/"):
                lo, hi = parts[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return sorted(out)


def _in_ranges(addr: int, ranges: list[tuple[int, int]]) -> bool:
    i = bisect.bisect_right(ranges, (addr, 1 << 64)) - 1
    return i >= 0 and ranges[i][0] <= addr < ranges[i][1]


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


# --------------------------------------------------------------------------- host memory


def ram_available_bytes() -> int:
    """RAM available now, cgroup-aware (hardware.py's one reader, read afresh: the probe's cached
    figure predates the weights' load); 8 GiB where /proc cannot tell."""
    return hardware.ram_available_bytes() or 8 * GiB


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (whose malloc the two functions below tune), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> None:
    """Lets glibc's malloc keep freed memory for reuse instead of returning it to the kernel.

    By default an allocation above 128 KiB (a threshold that adapts, up to 32 MiB) is its own
    mmap, unmapped on free, so each step's large activations (gathered KV, MLP intermediates)
    fault in fresh zeroed pages again: a bf16 copy of 3.5 MB measured 199 us that way and 116 us
    from retained memory. This is PyTorch's CUDA caching allocator idea, done by glibc; vLLM's
    CPU backend gets the same from tcmalloc. The cost is that RSS stays at the peak the steps
    reached."""
    libc = _glibc()
    if libc is not None:
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's ceiling on 64-bit (HEAP_MAX / 2)
        libc.mallopt(m_trim_threshold, 256 << 20)


def release_freed_memory() -> None:
    """Returns the heap's free memory to the kernel once (glibc malloc_trim): startup's
    transients (GGUF dequantization, the profiling forward, inductor's compile) would otherwise
    stay in RSS, since `keep_freed_memory` asks malloc to keep what is freed."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
