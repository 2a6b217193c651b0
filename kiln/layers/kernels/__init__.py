"""kiln's CPU kernel layer: which ISA level runs (isa.py), the builder (build.py), the ops'
Python faces (ops.py), the choosers that give each layer its kernel with the reason
(choose.py) and the threads they run on (threads.py). The rest of kiln asks here, and only
here, whether a kernel runs.

    formats.py  the weight formats: GGUF's block types and dequantizer, kiln's int4 groups
    isa.py      the probe: CPU flags + XCR0 (what the OS grants) + AMX permission; LEVELS
    reference.py  the kernels in PyTorch: pack_q4's layout, references, fakes, self-checks
    build.py    one library per level from one source (the .cpp and .h files here),
                each checked against reference.py before use
    ops.py      q4_linear, moe_q4, attend_rows, q8_linear, lora_add, rms_norm, rope_write,
                silu_mul, decode_layer, decode_stack (+ kiln/layers/quant/gguf_blocks.py: kq_linear)
    choose.py   choose_linear_kernel / choose_attention_kernel / choose_lora_kernel /
                choose_cpu_kernels -> (kernel, reasons)
    threads.py  the thread governor: fewer compute threads while other processes hold CPUs

The process runs one level at a time (`select`, from --cpu-isa at startup; `auto`: the best
that runs). Every level a CPU can run loads side by side (torch.ops.kiln_avx2,
torch.ops.kiln_avx512), so tests switch with `at_level`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from kiln.layers.kernels.isa import BY_NAME, LEVEL_NAMES, LEVELS, cpu_runs

log = logging.getLogger("kiln.kernels")

# The level that runs: None until chosen (the first use chooses `auto`); "" where none runs.
_level: str | None = None
_reason = ""


def runnable_levels() -> list[str]:
    """The levels this machine runs (CPU, OS and a working library), best first."""
    # build (and through it torch) loads when a level is chosen, not with this package: the
    # hardware probe, `kiln doctor` and the settings read flags.py / isa.py, which run this
    # __init__, and must stay quick without torch. No circle: build never imports this module.
    from kiln.layers.kernels.build import library

    return [lv.name for lv in LEVELS if library(lv.name)]


def select(requested: str = "auto") -> tuple[str | None, str]:
    """Chooses the process's level: `auto` the best that runs, or the one asked for (a level
    above what runs here is refused, saying which run). Returns (level or None, reason)."""
    from kiln.errors import ConfigError
    from kiln.layers.kernels.build import library  # deferred: see runnable_levels

    global _level, _reason
    if requested == "auto":
        # best first; the first that builds wins (a start builds only the level it runs)
        runs = next(([lv.name] for lv in LEVELS if library(lv.name)), [])
        if runs:
            _level, _reason = runs[0], f"the best level this CPU and OS run: {BY_NAME[runs[0]].about}"
        else:
            whys = "; ".join(f"{lv.name}: {cpu_runs(lv) or 'the library did not build'}"
                             for lv in LEVELS)
            _level, _reason = "", f"no level runs here ({whys}): PyTorch's paths"
    else:
        if requested not in BY_NAME:
            raise ConfigError(f"--cpu-isa {requested!r}: one of auto, {', '.join(LEVEL_NAMES)}")
        if not library(requested):
            runs = runnable_levels()
            why = cpu_runs(BY_NAME[requested]) or "its library did not build (see the log)"
            raise ConfigError(f"--cpu-isa {requested}: {why}",
                              hint=f"this machine runs: {', '.join(runs) or 'none'} "
                                   "(--cpu-isa auto picks the best)")
        _level, _reason = requested, "asked for (--cpu-isa / KILN_CPU_ISA)"
    log.info("CPU kernels: %s (%s)", _level or "none", _reason)
    return _level or None, _reason


def ensure_selected(requested: str = "auto") -> str | None:
    """`select(requested)` unless `auto` is asked and a level is chosen already (a test's
    `at_level`, or an earlier runner of this process)."""
    if requested != "auto" or _level is None:
        select(requested)
    return _level or None


def level() -> str | None:
    """The level that runs (choosing `auto` on first use); None: no kiln kernel runs."""
    if _level is None:
        select("auto")
    return _level or None


def reason() -> str:
    level()
    return _reason


def available() -> bool:
    """Whether kiln's kernels run in this process (at the selected level)."""
    return level() is not None


def lib() -> Any:
    """torch.ops.kiln_<level>: the selected level's ops."""
    import torch

    lv = level()
    assert lv, "kiln's CPU kernels do not run here (ask kernels.available() first)"
    return getattr(torch.ops, f"kiln_{lv}")


@contextlib.contextmanager
def at_level(name: str) -> Iterator[None]:
    """Runs the block at level `name` (tests; modules built inside keep their weights in the
    one layout every level reads, so they run at any level)."""
    global _level, _reason
    saved = (_level, _reason)
    select(name)
    try:
        yield
    finally:
        _level, _reason = saved
