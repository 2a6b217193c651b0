"""The one JSONL writer behind every trace, the per-step recorders, and the startup stages.

    --profile-jsonl          StepProfiler: per sampled step, phases (schedule, prepare, forward,
                             sample, detokenize) in ms, rows, tokens; `layers` adds per-layer ms
    --scheduler-trace-jsonl  SchedulerTracer: per step, queue lengths, tokens by kind, prefix-cache
                             hits, preemptions, free KV blocks
    --memory-profile-jsonl   StartupStages: RSS (and CUDA memory) at each startup stage and at
                             shutdown

The engine holds `None` for a trace that is off and tests `is not None` before touching it, so a
step with every trace off formats nothing and reads no clock it did not read before.
"""

from __future__ import annotations

import atexit
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from kiln.errors import DiagnosticFault

# The startup stages, in order (a fault `startup:STAGE` may name any but process_start).
STAGES = ("process_start", "settings_resolved", "weights_loaded", "kernels_ready",
          "kv_allocated", "compiled", "ready")


class JsonlWriter:
    """One JSON object a line, appended through a buffered file; `close()` (shutdown) flushes.
    Thread-safe: the engine thread and the event loop's thread may both write."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: TextIO | None = self.path.open("w", buffering=1 << 16)
        self._lock = threading.Lock()
        # The front-ends close it on shutdown; this covers those that just exit (kiln run, LLM).
        atexit.register(self.close)

    def write(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, default=str, separators=(",", ":")) + "\n"
        with self._lock:
            if self._f is not None:
                self._f.write(line)

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


# --------------------------------------------------------------------------- per step


class StepProfiler:
    """Phase timings of sampled steps. The engine asks `want()` once per step; only then does
    it read the clock between phases and call `record`. Sampling is by an accumulator, so a
    rate of 0.25 profiles exactly every fourth step (no random numbers, reproducible)."""

    def __init__(self, writer: JsonlWriter, *, sample_rate: float = 1.0, detail: str = "basic",
                 meta: dict[str, Any] | None = None, sync: Callable[[], None] | None = None
                 ) -> None:
        self.writer = writer
        self.rate = sample_rate
        self.detail = detail
        # CUDA runs asynchronously: a profiled step synchronizes between phases (sampled steps
        # only), so their times are the device's, not the launch queue's.
        self.sync = sync
        self._acc = 0.0
        self.layer_ms: list[float] | None = None  # filled by the layer hooks ("layers" detail)
        self._layer_t0 = 0.0
        writer.write({"kind": "meta", "time": time.time(), **(meta or {})})

    def want(self) -> bool:
        self._acc += self.rate
        if self._acc >= 1.0:
            self._acc -= 1.0
            if self.layer_ms is not None:
                self.layer_ms.clear()
            return True
        return False

    def record(self, step: int, marks: dict[str, float], rows: int, tokens: int,
               prefill_tokens: int, decode_tokens: int) -> None:
        """`marks`: phase name -> seconds (already differences)."""
        obj: dict[str, Any] = {
            "kind": "step", "step": step, "time": time.time(), "rows": rows, "tokens": tokens,
            "prefill_tokens": prefill_tokens, "decode_tokens": decode_tokens,
            **{f"{k}_ms": round(v * 1e3, 4) for k, v in marks.items()},
        }
        obj["total_ms"] = round(sum(marks.values()) * 1e3, 4)
        if self.layer_ms:
            obj["layers_ms"] = [round(x, 4) for x in self.layer_ms]
        self.writer.write(obj)

    def attach_layer_hooks(self, layers: Any) -> None:
        """"layers" detail: forward hooks on each decoder layer time it (eager steps only: the
        CPU decode kernel and compiled graphs run layers without calling the module)."""
        self.layer_ms = []

        def pre(_m: Any, _a: Any) -> None:
            if self.sync is not None:
                self.sync()
            self._layer_t0 = time.perf_counter()

        def post(_m: Any, _a: Any, _o: Any) -> None:
            if self.sync is not None:
                self.sync()
            assert self.layer_ms is not None
            self.layer_ms.append((time.perf_counter() - self._layer_t0) * 1e3)

        for layer in layers:
            layer.register_forward_pre_hook(pre)
            layer.register_forward_hook(post)

    def close(self) -> None:
        self.writer.close()


class SchedulerTracer:
    """One line per step with what the scheduler decided. kiln preempts by recompute and never
    swaps KV out, so `swapped` is always 0 (kept for vLLM-shaped readers)."""

    def __init__(self, writer: JsonlWriter) -> None:
        self.writer = writer
        self._hits = 0
        self._preemptions = 0

    def record(self, step: int, *, running: int, waiting: int, prefill_tokens: int,
               decode_tokens: int, preempted: int, prefix_hit_tokens_total: int,
               kv_blocks_free: int, kv_blocks_total: int) -> None:
        hits = prefix_hit_tokens_total - self._hits
        self._hits = prefix_hit_tokens_total
        self.writer.write({
            "step": step, "time": time.time(), "running": running, "waiting": waiting,
            "swapped": 0, "prefill_tokens": prefill_tokens, "decode_tokens": decode_tokens,
            "prefix_cache_hit_tokens": hits, "preemptions": preempted,
            "kv_blocks_free": kv_blocks_free, "kv_blocks_total": kv_blocks_total})

    def close(self) -> None:
        self.writer.close()


# --------------------------------------------------------------------------- startup stages


def memory_sample() -> dict[str, Any]:
    """RSS now and its peak; CUDA's allocated / reserved / peak bytes where CUDA is already in
    use (never initializes it)."""
    from kiln.resolve.hardware import rss_bytes, rss_peak_bytes

    out: dict[str, Any] = {"rss_bytes": rss_bytes(), "rss_peak_bytes": rss_peak_bytes()}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
        out["cuda_reserved_bytes"] = torch.cuda.memory_reserved()
        out["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


class StartupStages:
    """Marks the startup stages: writes a memory line per stage (with --memory-profile-jsonl)
    and raises a `startup:STAGE` diagnostic fault there. Installed for the process by
    `install` (the runner, deep inside the engine's construction, marks its stages through the
    module function `stage`)."""

    def __init__(self, writer: JsonlWriter | None, fail_at: str | None = None,
                 process_start: tuple[float, dict[str, Any]] | None = None) -> None:
        self.writer = writer
        self.fail_at = fail_at
        self.t0 = process_start[0] if process_start else time.monotonic()
        if writer is not None and process_start is not None:
            self._write("process_start", process_start[1], process_start[0])

    def _write(self, name: str, sample: dict[str, Any], t: float) -> None:
        assert self.writer is not None
        self.writer.write({"stage": name, "time": time.time(),
                           "since_start_s": round(t - self.t0, 4), **sample})

    def mark(self, name: str) -> None:
        if self.writer is not None:
            self._write(name, memory_sample(), time.monotonic())
        if self.fail_at == name:
            raise DiagnosticFault(f"startup stage {name!r} failed by --diagnostic-fault "
                                  f"startup:{name}",
                                  hint="a drill: drop the --diagnostic-fault flag to start",
                                  code="fault.startup")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


_stages: StartupStages | None = None
_process_start: tuple[float, dict[str, Any]] | None = None


def note_process_start() -> None:
    """Reads RSS once as the front-end starts, before the settings say where a memory profile
    goes (one /proc read, kept until `install`)."""
    global _process_start
    _process_start = (time.monotonic(), memory_sample())


def install(memory_path: str | Path | None, fail_at: str | None) -> StartupStages | None:
    """Turns stage marking on for this process (None when neither a memory profile nor a
    startup fault is asked for)."""
    global _stages
    if memory_path is None and fail_at is None:
        _stages = None
        return None
    _stages = StartupStages(JsonlWriter(memory_path) if memory_path else None, fail_at,
                            _process_start)
    return _stages


def stage(name: str) -> None:
    if _stages is not None:
        _stages.mark(name)


def shutdown_stages() -> None:
    """The shutdown line, then flush and close."""
    global _stages
    st = _stages
    _stages = None
    if st is not None:
        if st.writer is not None:
            st._write("shutdown", memory_sample(), time.monotonic())
        st.close()
