"""The one builder of kiln's C++ CPU kernels: one library per ISA level (isa.LEVELS), each the
same sources (SOURCES, HEADERS; docs/kernels.md maps them) compiled with that
level's -m flags into torch.ops.kiln_<level>.

Built with torch.utils.cpp_extension (g++ and ninja, ~30 s a level) into ~/.cache/kiln/ext,
keyed by the sources, torch, the flags and this CPU, so later starts only load it; `make
install` builds ahead (`python -m kiln.layers.kernels`). A level this CPU cannot run is never
loaded (its static initializers could hold its instructions), but `compile_only` still
compiles it to an object file: CI on any CPU keeps every level's code compiling.

Why C++ at all: decode reads every weight once per token, so the kernels are a memory stream
with int8 dot products on it; PyTorch's int4 CPU kernel is compute-bound there ([1,1024] x
[768,1024]: ~140 us on one Zen 3 thread vs ~38 us for q4_linear) and its per-op dispatch and
parallel regions cost a third of a small model's step (see layers.cpp's decode_layer).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from kiln.layers.kernels import reference
from kiln.layers.kernels.isa import BY_NAME, Level, cpu_runs, prefetch_ahead
from kiln.paths import cache_dir
from kiln.resolve.hardware import cpu_signature

log = logging.getLogger("kiln.kernels")

HERE = Path(__file__).parent
# The compute-only sources include no ATen header (kernels.h, kquant.h): parsing ATen costs a
# source ~2-6 s of a level's build, so the ATen-facing ops sit in four (ops.h). Longest first:
# ninja starts them in this order, and the short ones fill the cores at the end.
SOURCES = tuple(HERE / f for f in (
    "layers.cpp", "kquant.cpp", "ops.cpp", "kquant_tiles.cpp", "lora.cpp", "attention.cpp",
    "q4_tiles.cpp", "moe.cpp", "kquant_dots.cpp", "mla.cpp", "layers_kq.cpp"))
HEADERS = (HERE / "simd.h", HERE / "kernels.h", HERE / "kquant.h", HERE / "ops.h")
# -mtune=native: scheduling for this CPU, no instruction beyond the level's -m flags.
# -fno-tree-loop-distribute-patterns: GCC turned the zeroing of a tile kernel's accumulator
# arrays (tile_dot's `acc[m] = 0` loop) into two `rep stosq` of 128 bytes at each call, ~7% of
# tile_dot<4>'s samples: calls that run 12 groups (a MoE down projection) pay it per tile. With
# the flag they are eight vector stores. MoE benchmark model, 16 rows in process, AMD EPYC Zen 3,
# the two builds alternated three times: 1.02-1.05x tok/s; the same bits (codegen only).
BASE_CFLAGS = ("-O3", "-mtune=native", "-fno-tree-loop-distribute-patterns", "-fopenmp",
               "-std=c++17")


def cflags(level: Level) -> list[str]:
    return [*BASE_CFLAGS, *level.cflags, f"-DKILN_NS=kiln_{level.name}"]


def _key(level: Level, files: list[str], *extra: str) -> str:
    """The hash naming a level's build folder: its files' text, torch, the flags, and `extra`."""
    return hashlib.sha256("\n".join([*files, torch.__version__, " ".join(cflags(level)),
                                     *extra]).encode()).hexdigest()[:16]


def build_dir(level: Level) -> Path:
    # The sources' paths are part of the key: torch's builder rebuilds (~30 s) when the path in a
    # build folder's ninja file changes, so two checkouts sharing one folder rebuilt at each start.
    parts = [str(p.resolve()) + "\n" + p.read_text() for p in (*SOURCES, *HEADERS)]
    return cache_dir("ext", f"kiln_{level.name}-{_key(level, parts, cpu_signature(), sys.version)}")


def _ninja_on_path() -> None:
    """torch's extension builder runs `ninja` from PATH; the `ninja` package (a dependency)
    installs it next to this interpreter, which need not be on PATH (.venv/bin/python ...)."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


# torch's builder holds `lock` in the build folder while it compiles and waits, forever, for a
# lock it finds: a start killed mid-build (Ctrl-C twice, SIGKILL, a test run stopped) left one,
# and every later start hung. A build takes under a minute; a lock this old has no builder.
STALE_LOCK_S = 300


def _drop_stale_lock(folder: Path) -> None:
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale build lock (%.0f s old, its builder is gone): %s", age, lock)
        lock.unlink(missing_ok=True)


def _build(level: Level) -> tuple[bool, bool]:
    """Builds (or loads the cached build of) `level`'s library. Returns (loaded, was cached); a
    failure is logged."""
    out = build_dir(level)
    try:
        from torch.utils.cpp_extension import load

        _ninja_on_path()
        out.mkdir(parents=True, exist_ok=True)
        _drop_stale_lock(out)
        cached = any(out.glob("*.so"))
        load(name=f"kiln_{level.name}", sources=[str(s) for s in SOURCES],
             extra_cflags=cflags(level), extra_ldflags=["-fopenmp"], build_directory=str(out),
             is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no headers, odd platform: fall back
        first = str(e).splitlines()[0] if str(e) else ""
        log.warning("kiln's CPU kernels (%s) could not be built (%s: %s); using PyTorch's paths",
                    level.name, type(e).__name__, first)
        return False, False
    return True, cached


@functools.cache
def library(name: str) -> bool:
    """`name`'s library built, loaded, its fake ops registered and its arithmetic checked
    against PyTorch, once. False, with the reason logged, where it cannot run here."""
    level = BY_NAME[name]
    if (why := cpu_runs(level)) is not None:
        log.info("kiln's %s kernels do not run here: %s", name, why)
        return False
    t0 = time.monotonic()
    ok, cached = _build(level)
    if not ok:
        return False
    ns = getattr(torch.ops, f"kiln_{name}")
    if ns.isa() != name:
        log.warning("kiln's %s library reports %s: not used", name, ns.isa())
        return False
    reference.register_fakes(f"kiln_{name}")
    if not reference.self_check(ns):
        log.warning("kiln's %s kernels disagree with PyTorch on this machine: not used", name)
        return False
    pf, why = prefetch_ahead()
    ns.set_prefetch_ahead(pf)
    log.info("kiln's %s kernels %s in %.1f s (%s); weights prefetched %s", name,
             "loaded" if cached else "built", time.monotonic() - t0, build_dir(level), why)
    return True


def _compiler() -> str:
    r = subprocess.run(["c++", "--version"], capture_output=True, text=True, check=False)
    return r.stdout.splitlines()[0] if r.stdout else ""


def compile_only(name: str) -> tuple[bool, str]:
    """Compiles `name`'s sources to object files without loading them (a level this CPU cannot
    run: CI keeps its code compiling). Returns (ok, the compiler's first error line).

    A success is remembered in a folder keyed as build_dir's is (`_key`: sources, headers, flags,
    torch, and the compiler): `make install` compiles, the kernel-layer test then finds the same inputs already
    compiled (~90 s of a 2-core CI run). Any edit to a source changes the key and compiles again."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils.cpp_extension import include_paths

    level = BY_NAME[name]
    key = _key(level, [p.read_text() for p in (*SOURCES, *HEADERS)], _compiler())
    out = cache_dir("ext", f"compile-only-{name}-{key}")
    if (out / "ok").exists():
        return True, ""
    out.mkdir(parents=True, exist_ok=True)
    incs = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"

    def one(src: Path) -> str:
        cmd = ["c++", *cflags(level), "-fPIC", abi, *incs, "-c", str(src),
               "-o", str(out / f"{src.stem}.o")]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode == 0:
            return ""
        errors = [ln for ln in r.stderr.splitlines() if "error" in ln] or [r.stderr[:200]]
        return f"{src.name}: {errors[0]}"

    # one compiler a core, as ninja runs a level's build
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        errors = [e for e in pool.map(one, SOURCES) if e]
    if errors:
        return False, errors[0]
    (out / "ok").touch()
    return True, ""
