"""Which instruction level kiln's CPU kernels run at: the one ISA probe and the level table.

A level runs here when three things agree (llama.cpp's cpu-feats and the Linux kernel's own
rule): the CPU has its instructions (/proc/cpuinfo's flags), the OS saves their registers
(XCR0, read with xgetbv by probe.c; a VM may show a flag whose state it does not enable, as
AMX's `amx_tile` on a kernel that never grants it), and kiln's library for the level was built
and passed its self-check (kiln/layers/kernels/build.py). Every other module asks this one,
through kiln.layers.kernels: nothing else reads CPU flags to pick a kernel.

    level    instructions (-m flags)                           CPUs
    avx512   AVX2 + FMA + F16C + AVX512 F/BW/VL/DQ/VNNI        Intel Cascade Lake and later
                                                               (Xeon, client Ice/Tiger Lake),
                                                               AMD Zen 4 / Zen 5
    avx2     AVX2 + FMA + F16C                                 x86 since ~2013 (Haswell, Zen 1-3)

Both levels are one source (the .cpp and .h files of kiln/layers/kernels/) compiled twice: the
same tile layouts, the same arithmetic, the same bits (see simd.h); avx512 replaces the int8 dot
products' vpmaddubsw + vpmaddwd pair with VNNI's vpdpbusd. `--cpu-isa` (KILN_CPU_ISA) forces a
lower level; the tests run every level the CPU can.

AMX: `amx_granted()` asks the kernel for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM), the
only way to know that a tile instruction will not fault; kt-kernel's AMX methods read it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kiln.layers.kernels.flags import AMX_FLAGS, AVX2_FLAGS
from kiln.paths import cache_dir

log = logging.getLogger("kiln.kernels")

# XCR0 bits: SSE and AVX state (1, 2); AVX-512's opmask, upper ZMM0-15 and ZMM16-31 (5, 6, 7);
# AMX's tile config and tile data (17, 18).
XCR0_AVX = 0b110
XCR0_AVX512 = XCR0_AVX | 0b1110_0000
XCR0_AMX = (1 << 17) | (1 << 18)



@dataclass(frozen=True)
class Level:
    """One instruction level of kiln's kernels: what the CPU must have (`flags`, /proc/cpuinfo
    names), what the OS must enable (`xcr0` bits) and how it is compiled (`cflags`)."""

    name: str
    flags: frozenset[str]
    xcr0: int
    cflags: tuple[str, ...]
    about: str


# Best first: `auto` takes the first that runs.
LEVELS: tuple[Level, ...] = (
    Level("avx512", frozenset({*AVX2_FLAGS, "avx512f", "avx512bw", "avx512vl", "avx512dq",
                               "avx512_vnni"}), XCR0_AVX512,
          ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
           "-mavx512dq", "-mavx512vnni"),
          "int8 dot products with AVX512-VNNI's vpdpbusd"),
    Level("avx2", AVX2_FLAGS, XCR0_AVX, ("-mavx2", "-mfma", "-mf16c"),
          "int8 dot products with vpmaddubsw + vpmaddwd"),
)
LEVEL_NAMES = tuple(lv.name for lv in LEVELS)
BY_NAME = {lv.name: lv for lv in LEVELS}


def x86_linux() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


@functools.cache
def cpu_flags() -> frozenset[str]:
    from kiln.resolve.hardware import cpu_flags as read_flags

    return read_flags()


@functools.cache
def xcr0() -> int | None:
    """XCR0 as the OS set it, or None where it cannot be read (not x86 Linux, no compiler)."""
    if not x86_linux():
        return None
    src = Path(__file__).with_name("probe.c")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    key = hashlib.sha256(src.read_bytes()).hexdigest()[:12]
    lib = cache_dir("ext") / f"probe-{key}.so"
    try:
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            tmp = lib.with_suffix(f".{id(lib)}.tmp")
            subprocess.run([cc, "-O1", "-shared", "-fPIC", str(src), "-o", str(tmp)],
                           check=True, capture_output=True, timeout=60)
            tmp.replace(lib)
        fn = ctypes.CDLL(str(lib)).kiln_xcr0
        fn.restype = ctypes.c_uint64
        return int(fn())
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not read XCR0 (%s): kiln's kernels stay off", e)
        return None


@functools.cache
def cpu_model_id() -> tuple[str, int, int] | None:
    """(vendor, family, model) of the first CPU in /proc/cpuinfo; None where it cannot be
    read (not x86 Linux)."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return None
    kv = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in first.splitlines())}
    try:
        return kv["vendor_id"], int(kv["cpu family"]), int(kv["model"])
    except (KeyError, ValueError):
        return None


# How far ahead of the weights they read the kernels' software prefetch asks for lines. The
# best distance differs between cores, even of one vendor; measured interleaved in one process
# at one row, 2 threads (docs/kernels.md, "Memory traffic"):
#   AMD Zen 2 (family 23): 1 KB; 2 KB made Qwen2.5-Coder-0.5B's layers 11% slower, SmolLM2's
#     int4 linears 9% (Dec 5).
#   AMD Zen 3 EPYC (family 25, models 0x00-0x0f): 2 KB; 1 KB made Qwen2.5-Coder-0.5B's decode
#     10% slower (8 of 8 rounds), the MoE benchmark model's 2-9%, SmolLM2's alike (Dec 7).
# Every other CPU: 1 KB until someone measures it (benchmarks: `kiln bench --offline`).
PREFETCH_DEFAULT = 1024


def prefetch_ahead() -> tuple[int, str]:
    """(bytes, why): the prefetch distance for this CPU (build.library sets it)."""
    ident = cpu_model_id()
    if ident is not None and ident[0] == "AuthenticAMD" and ident[1] == 25 and ident[2] < 0x10:
        return 2048, "2 KB ahead: AMD Zen 3 EPYC (family 25, model < 0x10), measured best there"
    return PREFETCH_DEFAULT, "1 KB ahead: measured best on Zen 2; other CPUs unmeasured"


def cpu_runs(level: Level) -> str | None:
    """None where this CPU and OS run `level`'s instructions; else why not."""
    if not x86_linux():
        return f"not x86-64 Linux ({platform.system()} {platform.machine()})"
    missing = sorted(level.flags - cpu_flags())
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    x = xcr0()
    if x is None:
        return "XCR0 could not be read (no C compiler?)"
    if x & level.xcr0 != level.xcr0:
        return f"the OS does not enable the registers (XCR0 {x:#x}, needs {level.xcr0:#x})"
    return None


@functools.cache
def amx_granted() -> bool:
    """Whether AMX tiles may be used: the flags, XCR0's tile bits and the kernel's permission
    (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0, Linux 5.16+). A flag alone is
    not enough: some VMs show amx_tile and fault on the first tile load."""
    if not x86_linux() or not AMX_FLAGS & cpu_flags():
        return False
    x = xcr0()
    if x is None or x & XCR0_AMX != XCR0_AMX:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sys_arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18
        return libc.syscall(sys_arch_prctl, req_xcomp_perm, xtiledata) == 0
    except (OSError, AttributeError):
        return False


def cpu_native_bf16() -> bool:
    """Whether bf16 matmuls run natively (AVX512-BF16, or AMX granted by the OS): the dtype
    rule for dense (unquantized) CPU models reads this."""
    level = BY_NAME["avx512"]
    return (cpu_runs(level) is None and "avx512_bf16" in cpu_flags()) or amx_granted()


def cpu_has_avx2() -> bool:
    """Whether this CPU and OS run the lowest level (doctor's warning, the fp16-KV rule)."""
    return cpu_runs(BY_NAME["avx2"]) is None
