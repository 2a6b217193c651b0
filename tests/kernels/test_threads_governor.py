"""The thread governor (kiln/layers/kernels/threads.py): fewer compute threads while other
processes hold some of our CPUs, back up once they free.

The decision is checked on /proc readings recorded on a 2-core machine while kiln decoded
SmolLM2; the last test starts a real busy loop on one of this process's CPUs."""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.layers.kernels.threads import (
    CpuSample,
    ThreadGovernor,
    decide,
    others_load,
    parse_proc_stat,
    parse_self_stat,
)

PROC_STAT = """\
cpu  26349 6886 6232 14260 295 0 67 98 0 0
cpu0 8477 4859 2350 11221 112 0 7 52 0 0
cpu1 17872 2026 3881 3038 183 0 60 45 0 0
intr 1897 0 0 0
ctxt 123456
"""


def test_proc_stat_busy_ticks_leave_out_idle_and_iowait() -> None:
    cpu0 = 8477 + 4859 + 2350 + 0 + 7 + 52
    cpu1 = 17872 + 2026 + 3881 + 0 + 60 + 45
    assert parse_proc_stat(PROC_STAT, {0}) == cpu0
    assert parse_proc_stat(PROC_STAT, {0, 1}) == cpu0 + cpu1
    # a CPU /proc/stat does not list (a container's renumbered view): no reading at all
    assert parse_proc_stat(PROC_STAT, {0, 5}) is None


def test_self_stat_counts_fields_after_the_command_name() -> None:
    # a command name with spaces and ')' must not shift utime (14) and stime (15)
    line = ("4668 (kiln ) engine) R 4665 4665 3519 0 -1 4194304 101 0 0 0 "
            "1234 56 0 0 20 0 3 0 27220 3133440 409 18446744073709551615")
    assert parse_self_stat(line) == 1234 + 56


# --------------------------------------------------------------------------- recorded readings

# (seconds, busy ticks of both CPUs, this process's ticks) about every 0.2 s (USER_HZ 100), read
# on a 2-core AMD EPYC while kiln decoded SmolLM2 at c=1 (kiln.LLM's engine stepping): quiet,
# then `python3 -c "while True: pass"` from 2.0 s to 4.5 s. "governed": the governor lowered
# the count to 1 at the first reading of the loop; "two threads": it only read (the count
# stayed 2, so the loop shared a CPU with one of our threads and read 0.4-0.9, not 1.0).
RECORDED = {
    "governed": [
        (0.206, 0, 0), (0.407, 40, 40), (0.609, 81, 80), (0.81, 121, 120), (1.012, 161, 160),
        (1.214, 202, 200), (1.415, 241, 240), (1.62, 282, 281), (1.825, 323, 321),
        (2.033, 363, 361), (2.279, 413, 391), (2.482, 454, 411), (2.682, 494, 431),
        (2.891, 536, 452), (3.094, 576, 472), (3.305, 619, 493), (3.51, 660, 513),
        (3.716, 700, 533), (3.917, 740, 552), (4.118, 781, 572), (4.321, 822, 593),
        (4.531, 861, 614), (4.736, 882, 634), (4.941, 924, 674), (5.146, 964, 715),
        (5.349, 1004, 755), (5.549, 1045, 795), (5.755, 1086, 836), (5.968, 1128, 878)],
    "two threads": [
        (0.204, 0, 0), (0.406, 41, 40), (0.61, 81, 80), (0.815, 122, 120), (1.016, 162, 160),
        (1.218, 203, 200), (1.425, 243, 241), (1.628, 284, 282), (1.829, 324, 321),
        (2.042, 368, 362), (2.254, 408, 393), (2.509, 459, 424), (2.712, 501, 455),
        (2.914, 541, 485), (3.118, 581, 507), (3.325, 621, 537), (3.538, 665, 564),
        (3.838, 725, 602), (4.092, 776, 634), (4.307, 819, 661), (4.514, 860, 691),
        (4.72, 901, 732), (4.923, 941, 772), (5.128, 982, 813), (5.331, 1023, 854),
        (5.537, 1063, 894), (5.741, 1105, 934), (5.946, 1145, 975)],
}
HOG_ON, HOG_OFF = 2.0, 4.5


def _replay(readings: list[tuple[float, int, int]], start: int) -> list[tuple[float, float, int]]:
    """(time, others' load, the count decide gives) after each reading, from `start` threads."""
    out, n = [], start
    for prev, cur in itertools.pairwise(readings):
        a, b = CpuSample(*prev), CpuSample(*cur)
        others = others_load(a, b, 100.0)
        n = decide(n, 2, 2, others)
        out.append((b.t, others, n))
    return out


@pytest.mark.parametrize("recording", sorted(RECORDED))
def test_recorded_decode_keeps_two_threads_while_quiet_one_beside_a_busy_loop(
        recording: str) -> None:
    trace = _replay(RECORDED[recording], 2)
    quiet = [n for t, _, n in trace if t < HOG_ON]
    # libgomp's workers spin between regions: our own time, never read as a neighbour
    assert quiet and all(n == 2 for n in quiet), trace
    lowered = [t for t, _, n in trace if HOG_ON <= t < HOG_OFF and n == 1]
    assert lowered and lowered[0] - HOG_ON < 1.0, trace
    assert all(n == 1 for t, _, n in trace if lowered[0] <= t < HOG_OFF), trace
    raised = [t for t, _, n in trace if t >= HOG_OFF and n == 2]
    assert raised and raised[0] - HOG_OFF < 1.0, trace


# --------------------------------------------------------------------------- the decision


@pytest.mark.parametrize("current, others, want", [
    (2, 0.0, 2), (2, 0.3, 2),          # a light neighbour: keep both
    (2, 0.6, 1), (2, 1.0, 1),          # a busy one: one thread per CPU left
    (2, 2.0, 1),                       # never below one
    (1, 1.0, 1), (1, 0.4, 1),          # still there, or in the band: stay low
    (1, 0.1, 2), (1, 0.0, 2),          # gone: back up
])
def test_decide_on_two_cpus(current: int, others: float, want: int) -> None:
    assert decide(current, 2, 2, others) == want


def test_decide_has_a_band_where_nothing_changes() -> None:
    # between the raise and the lower thresholds each count stays where it is: no flapping
    for others in (0.25, 0.3, 0.39):
        assert decide(2, 2, 2, others) == 2
        assert decide(1, 2, 2, others) == 1


def test_decide_stays_within_the_configured_count() -> None:
    # --threads 8 on 16 CPUs: a neighbour on 3 of them leaves 13, more than asked for
    assert decide(8, 8, 16, 3.0) == 8
    assert decide(8, 8, 16, 9.0) == 7
    assert decide(4, 8, 16, 0.0) == 8
    # 8 of 8 CPUs, two neighbours: six threads, and back in one step when they leave
    assert decide(8, 8, 8, 2.0) == 6
    assert decide(6, 8, 8, 0.1) == 8


# --------------------------------------------------------------------------- the governor on a fake /proc


class _FakeProc:
    """A /proc folder whose counters a test advances: `tick(dt, busy, own)` in seconds and
    CPUs' worth of time."""

    def __init__(self, root: Path) -> None:
        self.root, self.t, self.busy, self.own = root, 0.0, 0, 0
        (root / "self").mkdir(parents=True)
        self._write()

    def tick(self, dt: float, busy: float, own: float) -> None:
        self.t += dt
        self.busy += round(busy * dt * 100)
        self.own += round(own * dt * 100)
        self._write()

    def _write(self) -> None:
        half = self.busy // 2
        (self.root / "stat").write_text(f"cpu  0 0 0 0 0 0 0 0 0 0\ncpu0 {half} 0 0 9 0 0 0 0 0 0"
                                        f"\ncpu1 {self.busy - half} 0 0 9 0 0 0 0 0 0\n")
        (self.root / "self" / "stat").write_text(
            f"7 (python) R 1 1 1 0 -1 0 0 0 0 0 {self.own} 0 0 0 20 0 3 0 1 1 1")


def test_governor_lowers_between_polls_logs_and_raises(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    proc = _FakeProc(tmp_path)
    calls: list[int] = []
    gov = ThreadGovernor(2, proc=tmp_path, cpus={0, 1}, set_threads=calls.append,
                         clock=lambda: proc.t)
    assert gov.enabled and gov.active == 2
    proc.tick(0.2, busy=2.0, own=2.0)  # decoding alone (its spinning workers included)
    assert gov.poll() is None and calls == []
    proc.tick(0.05, busy=2.0, own=1.0)  # too soon after the last reading: not read
    assert gov.poll() is None
    with caplog.at_level(logging.INFO, logger="kiln.threads"):
        proc.tick(0.2, busy=2.0, own=1.2)  # a neighbour took most of a CPU
        assert gov.poll() == 1
    assert calls == [1] and gov.active == 1
    assert "compute threads 2 -> 1" in caplog.text
    proc.tick(0.2, busy=2.0, own=1.0)  # still there
    assert gov.poll() is None
    proc.tick(0.2, busy=1.0, own=1.0)  # gone
    assert gov.poll() == 2 and calls == [1, 2] and gov.changes == 2


def test_governor_after_an_idle_gap_judges_only_the_time_since(tmp_path: Path) -> None:
    proc = _FakeProc(tmp_path)
    calls: list[int] = []
    gov = ThreadGovernor(2, proc=tmp_path, cpus={0, 1}, set_threads=calls.append,
                         clock=lambda: proc.t)
    # idle for a minute while another process ran its own burst (0.8 CPU on average)
    proc.tick(60.0, busy=0.8, own=0.0)
    assert gov.poll() is None  # only a new window starts
    proc.tick(0.2, busy=2.0, own=2.0)  # the burst is over; our step runs alone
    assert gov.poll() is None and calls == [] and gov.others == 0.0


def test_governor_is_off_without_proc(tmp_path: Path) -> None:
    calls: list[int] = []
    gov = ThreadGovernor(2, proc=tmp_path / "missing", cpus={0, 1}, set_threads=calls.append)
    assert not gov.enabled
    assert gov.poll() is None and gov.active == 2 and calls == []


def test_governor_is_off_on_one_cpu(tmp_path: Path) -> None:
    _FakeProc(tmp_path)
    gov = ThreadGovernor(1, proc=tmp_path, cpus={0}, set_threads=lambda n: None)
    assert not gov.enabled


# --------------------------------------------------------------------------- a real neighbour


def _poll_until(gov: ThreadGovernor, want: int, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        gov.poll()
        if gov.active == want:
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or not Path("/proc/stat").exists(),
                    reason="needs Linux's /proc and affinity masks")
def test_a_busy_loop_on_one_of_our_cpus_lowers_the_torch_threads_and_its_end_raises_them(
) -> None:
    import torch

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to give up")
    before = torch.get_num_threads()
    n = len(cpus)
    torch.set_num_threads(n)
    gov = ThreadGovernor(n, interval=0.1)
    try:
        # a machine already busy (another job) would read as a neighbour from the start
        time.sleep(0.3)
        gov.poll()
        if gov.active != n:
            pytest.skip(f"others already use {gov.others:.1f} of the CPUs: not a quiet machine")
        hog_code = f"import os; os.sched_setaffinity(0, {{{cpus[-1]}}})\nwhile True: pass"
        hog = subprocess.Popen([sys.executable, "-c", hog_code])
        try:
            took = _poll_until(gov, n - 1, timeout=1.5)
            assert took is not None, f"still {gov.active} threads; others {gov.others:.2f}"
            assert torch.get_num_threads() == n - 1
        finally:
            hog.kill()
            hog.wait()
        took = _poll_until(gov, n, timeout=1.5)
        assert took is not None, f"still {gov.active} threads; others {gov.others:.2f}"
        assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- the engine's hook


def test_engine_reports_its_threads_and_the_setting_turns_the_governor_off(make_engine) -> None:
    from kiln.server.metrics import render

    eng = make_engine()
    assert eng.threads is not None and eng.threads.max_threads == eng.runner.num_threads
    stats = eng.metrics()
    assert stats["cpu_threads_active"] == eng.threads.active
    assert "kiln:cpu_threads_active" in render(stats, "m")
    off = make_engine(adaptive_threads=False)
    assert off.threads is None
    assert off.metrics()["cpu_threads_active"] == off.runner.num_threads
