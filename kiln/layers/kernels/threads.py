"""The thread governor: fewer compute threads while other processes hold some of our CPUs.

Why: torch's ops and kiln's C++ kernels run OpenMP parallel regions of torch's thread count
(`at::get_num_threads()`), and each region ends in a barrier. When another process keeps one of
the CPUs this process may run on busy, the OS shares that CPU between it and one of our threads,
and every barrier waits for that thread's next time slice (about 150 barriers a decode step).
SmolLM2 at c=1 on 2 cores beside `python3 -c "while True: pass"` kept 25-68% of its quiet speed
(issue #40 saw ~0.8 tokens/s); with one thread per CPU still free, no region waits for a
descheduled member, and it kept 69-83%.

The signal, sampled at most every `interval` seconds (two small /proc reads):

    others = busy time of the CPUs in our affinity mask (/proc/stat: all but idle and iowait,
             steal included: a hypervisor's neighbour is a neighbour too)
           - this process's own CPU time (/proc/self/stat utime + stime)

in CPUs (ticks over the window's ticks). libgomp's workers spin at the end of each region
(GOMP_SPINCOUNT) and the engine thread's neighbours in this process (HTTP, detokenizing) run
too: both are our own time, so they never look like a neighbour. The count is lowered to the
CPUs left (at least 1) when others take more than 0.4 of a CPU, and raised again, up to the
configured `--threads`, once they use no more than 0.2 of it (`decide`; the gap between the two
is the hysteresis). The reading is the same whatever our own count, so raising needs no
trial run: with one thread on 2 CPUs, a busy neighbour still reads as 1 CPU, a gone one as 0.

The engine consults the governor between steps only (Engine.step), on the thread that runs the
model, since OpenMP's thread count is that thread's own setting; a region never changes size
mid-step. Where /proc or the affinity mask cannot be read (macOS, Windows), it does nothing.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kiln.threads")

# Seconds between two readings: a neighbour is noticed within two of them (the first step after
# it starts may still run at the old count), and a reading costs ~50 us.
INTERVAL_S = 0.2
# A reading older than this (the engine sat idle between requests) only starts a new window: its
# average would describe the idle minutes (another server's burst in them), not the CPUs now.
MAX_WINDOW_S = 1.0
# A CPU is given up when other processes use more than LOWER_ABOVE of it, and taken back when
# they use at most RAISE_BELOW (between the two nothing changes: no flapping). Measured on 2
# cores while SmolLM2 decoded with 2 threads: a quiet machine reads -0.1..0.1 (tick rounding);
# `while True: pass` reads 0.45..0.95 while it shares a CPU with one of our threads and
# 0.95..1.08 once we leave it that CPU.
LOWER_ABOVE = 0.4
RAISE_BELOW = 0.2


@dataclass(frozen=True)
class CpuSample:
    """One reading: when (seconds, monotonic), the busy ticks of the watched CPUs summed, and this
    process's own ticks (user + system)."""

    t: float
    busy: int
    own: int


def parse_proc_stat(text: str, cpus: Collection[int]) -> int | None:
    """Busy ticks of `cpus` summed from /proc/stat's `cpuN` lines (user nice system idle iowait
    irq softirq steal ...; guest time is inside user already); None when one of them is
    missing (a virtualised /proc/stat that renumbers CPUs: the governor then stays off)."""
    want = {f"cpu{c}" for c in cpus}
    busy, seen = 0, 0
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, _, rest = line.partition(" ")
        if name not in want:
            continue
        f = [int(x) for x in rest.split()]
        if len(f) < 4:
            return None
        # user + nice + system + irq + softirq + steal; not idle (3) nor iowait (4)
        busy += f[0] + f[1] + f[2] + sum(f[5:8])
        seen += 1
    return busy if seen == len(want) else None


def parse_self_stat(text: str) -> int:
    """utime + stime (ticks) from /proc/<pid>/stat. The command name (field 2) may hold spaces
    and parentheses, so the fields are counted after its last ')'."""
    rest = text[text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state): utime is field 14, stime 15
    return int(rest[11]) + int(rest[12])


def others_load(prev: CpuSample, cur: CpuSample, hz: float) -> float:
    """CPUs' worth of the watched CPUs other processes used between two readings (>= 0)."""
    dt = cur.t - prev.t
    if dt <= 0:
        return 0.0
    ticks = (cur.busy - prev.busy) - (cur.own - prev.own)
    return max(0.0, ticks / hz / dt)


def decide(current: int, max_threads: int, ncpus: int, others: float) -> int:
    """The thread count for the next steps, within 1..max_threads: one per CPU that other
    processes leave us (`ncpus - others`). A CPU counts as taken once they use more than
    LOWER_ABOVE of it, as free again once they use at most RAISE_BELOW; in between, `current`
    stays."""
    free = ncpus - others
    lower = math.floor(free + LOWER_ABOVE)
    if lower < current:
        return max(1, min(max_threads, lower))
    raise_to = math.floor(free + RAISE_BELOW)
    if raise_to > current:
        return max(1, min(max_threads, raise_to))
    return max(1, min(max_threads, current))


def _affinity() -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        return None


def _set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


class ThreadGovernor:
    """Lowers and raises the compute thread count as other processes take and free the CPUs
    this process may run on (module notes). `poll()` between steps, on the thread that runs
    the model; `active` is the count in use now."""

    def __init__(self, max_threads: int, *, interval: float = INTERVAL_S,
                 proc: Path = Path("/proc"), cpus: Collection[int] | None = None,
                 set_threads: Callable[[int], None] = _set_torch_threads,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = max(1, max_threads)
        self.active = self.max_threads
        self.interval = interval
        self.others = 0.0  # the last reading's others' load, in CPUs
        self.changes = 0
        self._proc = proc
        self._set = set_threads
        self._clock = clock
        self._hz = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        found = frozenset(cpus) if cpus is not None else _affinity()
        self.cpus = found or frozenset()
        self._last = self._read() if self.cpus else None
        # Off where /proc cannot be read, or with one CPU (nothing to give up).
        self.enabled = self._last is not None and len(self.cpus) > 1
        if not self.enabled:
            log.debug("thread governor off: %s", "one CPU" if self._last is not None
                      else "no /proc/stat for this process's CPUs")

    def _read(self) -> CpuSample | None:
        try:
            stat = (self._proc / "stat").read_text()
            own = (self._proc / "self" / "stat").read_text()
        except OSError:
            return None
        busy = parse_proc_stat(stat, self.cpus)
        if busy is None:
            return None
        return CpuSample(self._clock(), busy, parse_self_stat(own))

    def poll(self) -> int | None:
        """Reads /proc if `interval` has passed since the last reading and applies the count
        `decide` gives over the time since (not after an idle gap longer than MAX_WINDOW_S: that
        reading starts the next window); returns the new count when it changed, else None."""
        if not self.enabled or self._last is None:
            return None
        if self._clock() - self._last.t < self.interval:
            return None
        cur = self._read()
        if cur is None:
            return None
        last, self._last = self._last, cur
        if cur.t - last.t > MAX_WINDOW_S:
            return None
        self.others = others_load(last, cur, self._hz)
        n = decide(self.active, self.max_threads, len(self.cpus), self.others)
        if n == self.active:
            return None
        log.info("compute threads %d -> %d: other processes use %.1f of the %d CPUs this process "
                 "may run on (--threads %d; --no-adaptive-threads keeps it)", self.active, n,
                 self.others, len(self.cpus), self.max_threads)
        self._set(n)
        self.active = n
        self.changes += 1
        return n
