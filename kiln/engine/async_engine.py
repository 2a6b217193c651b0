"""AsyncEngine: the engine loop on its own thread, one async stream per request.

    HTTP handlers (event loop)                      engine thread
    ----------------------------                    ---------------------------------
    generate() -> commands.put(("add", ...))  --->  drain commands, engine.step()
    async for out in stream  <--- loop.call_soon_threadsafe(queue.put_nowait, out)
    (client gone) -> abort() -> commands.put  --->  engine.abort(): blocks freed at once

The thread sleeps on the command queue when there is no work (no busy spin). Every call into the
`Engine` happens on the engine thread, so the engine itself needs no locks.

The engine is also *built* on that thread (`AsyncEngine(factory)`): OpenMP keeps a team of worker
threads per master thread, and while the main thread's team exists (it would, had the main
thread loaded and warmed up the model), a second thread's parallel regions ran 2-2.5x slower
(SmolLM2 decode on 2 cores: 33 ms per token instead of 13). So every torch op of the server runs
on the engine thread, and the main thread only does HTTP, tokenization and detokenization.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from kiln.engine.engine import Engine, RequestOutput, StepFailedError
from kiln.engine.output import RequestMetrics
from kiln.engine.structured import StructuredOutputs
from kiln.errors import KilnError
from kiln.sampling_params import SamplingParams

log = logging.getLogger("kiln.async_engine")

# The GIL switch interval while an engine thread runs. Each torch op releases the GIL; when it
# returns, the engine thread waits for the event loop's thread (SSE, detokenized deltas, HTTP) to
# hand the GIL back, by default up to 5 ms, and a decode step is hundreds of ops. Measured on the
# MoE benchmark model (2 cores, c=1, kiln bench, alternated): TPOT 35-38 ms at 0.2 ms vs 40-47 ms
# at the default.
GIL_SWITCH_INTERVAL_S = 2e-4
# How stale /metrics may be while requests stream (it is current whenever one finishes).
SNAPSHOT_EVERY_S = 0.05


class EngineOverloadedError(KilnError):
    """Too many requests are waiting: the server answers 503."""


class EngineDeadError(KilnError):
    """The engine thread stopped after an unexpected error."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    stream: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    session_id: str | None = None
    group: str | None = None


class AsyncEngine:
    def __init__(self, engine: Engine | Callable[[], Engine], *, max_queue: int = 1024) -> None:
        """`engine`: the Engine, or a function that builds it, which `start` calls on the engine
        thread (see the module notes)."""
        self._factory = None if isinstance(engine, Engine) else engine
        self.engine: Engine | None = engine if isinstance(engine, Engine) else None
        self.max_queue = max_queue
        self._commands: queue.Queue[Any] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._stats: dict[str, float] = {}
        # MoE routing counters as of the last step ([layers, E]; None: a dense model), copied on
        # the engine thread like _stats, so /metrics never reads counters a step is adding to.
        self._routing: torch.Tensor | None = None
        self._snapshot_at = 0.0
        self._stop = threading.Event()
        self._built = threading.Event()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self.num_inflight = 0
        # Called on the engine thread with each finished request's metrics (/metrics' request
        # histograms); a listener must be quick and thread-safe (prometheus_client's are).
        self.finished_listeners: list[Callable[[RequestMetrics], None]] = []
        self._kv_integrity: str | None = None  # checked only with diagnostic faults on

    @property
    def structured(self) -> StructuredOutputs | None:
        """The engine's grammars (thread-safe), which the server compiles a request's output
        constraint with before admitting it; None until the engine is built, or without a
        tokenizer."""
        return self.engine.structured if self.engine is not None else None

    @property
    def max_model_len(self) -> int:
        assert self.engine is not None
        return self.engine.max_model_len

    def start(self, wait: bool = True) -> AsyncEngine:
        """Starts the engine thread, which builds the engine first; with `wait`, returns once it
        is built (see `wait_built`). Without, the caller can do other work meanwhile."""
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._thread.start()
        if wait:
            self.wait_built()
        return self

    def wait_built(self) -> Engine:
        """Blocks until the engine thread has built the engine; re-raises what building it
        raised."""
        self._built.wait()
        if self.engine is None:
            assert self._dead is not None
            raise self._dead
        return self.engine

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)

    # ------------------------------------------------------------------ request side

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, *, cache_salt: str | None = None,
                       session_id: str | None = None, group: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs (all `params.n` choices, as `params.output_kind` says) until
        it finishes; leaving early aborts it."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        if self._stats.get("num_waiting", 0) >= self.max_queue:
            raise EngineOverloadedError(
                f"the server is overloaded: {int(self._stats['num_waiting'])} requests waiting",
                hint="retry later, or raise --max-queue")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        cmd = _Add(request_id, prompt_token_ids, params, cache_salt, stream, loop, session_id,
                   group)
        self._commands.put(("add", cmd))
        self.num_inflight += 1
        done = False  # finished, refused or failed: nothing left to abort
        try:
            while True:
                # Validation errors (prompt too long, bad token id) come before any output; a
                # failed step's error, or a dead engine's, in place of one.
                item = await stream.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                yield item
                if item.finished:
                    done = True
                    return
        finally:
            self.num_inflight -= 1
            if not done:
                # The consumer went away: free the blocks now. Also while the first output is
                # still to come (a FINAL_ONLY request's first output is its last).
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stats(self) -> dict[str, float]:
        s = dict(self._stats)
        s["num_inflight"] = self.num_inflight
        return s

    async def kv_report(self, timeout: float = 30.0) -> dict[str, Any]:
        """Engine.kv_report, run on the engine thread between two steps (the KV manager is
        only ever touched there)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._commands.put(("kv_report", fut, loop))
        return await asyncio.wait_for(fut, timeout)

    async def call(self, fn: Callable[[Engine], Any], timeout: float = 300.0) -> Any:
        """`fn(engine)` on the engine thread between two steps (loading a LoRA adapter): its
        result, or what it raised."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._commands.put(("call", fn, fut, loop))
        return await asyncio.wait_for(fut, timeout)

    def routing_stats(self) -> dict[int, list[int]]:
        """{MoE layer: tokens routed to each expert} as of the last step ({} for a dense
        model); see Engine.routing_stats."""
        counts, engine = self._routing, self.engine
        if counts is None or engine is None:
            return {}
        return dict(zip(engine.moe_layers, counts.tolist()))

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            if self.engine is None:
                assert self._factory is not None
                self.engine = self._factory()
            self._snapshot(self.engine)
        except BaseException as e:  # noqa: BLE001 - wait_built() re-raises it on its thread
            self._dead = e
            return
        finally:
            self._built.set()
        self._loop()

    def _loop(self) -> None:
        eng = self.engine
        assert eng is not None
        idle_checked = False
        try:
            while not self._stop.is_set():
                block = not eng.has_unfinished
                self._drain(block)
                if not eng.has_unfinished and not eng.outputs_pending:
                    if eng.faults is not None and not idle_checked:
                        self._check_integrity(eng)
                        idle_checked = True
                    self._snapshot(eng)
                    continue
                idle_checked = False
                try:
                    outputs = eng.step()
                except StepFailedError as e:
                    # Only that step's requests fail (HTTP 500); the engine goes on.
                    self._fail(e.request_ids, e)
                    self._snapshot(eng)
                    continue
                # Stats first: a client that saw its request finish then finds it in /metrics.
                # Between finishes at most every SNAPSHOT_EVERY_S: a snapshot (the metrics dict,
                # a MoE model's routing counts copied) cost ~2% of a c=1 MoE decode step.
                now = time.monotonic()
                if (now - self._snapshot_at >= SNAPSHOT_EVERY_S
                        or any(out.finished for out in outputs)):
                    self._snapshot(eng)
                    self._snapshot_at = now
                self._deliver(outputs)
        except BaseException as e:
            log.exception("engine loop crashed")
            self._dead = e
            for q, loop in list(self._streams.values()):
                loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"engine crashed: {e}"))
            self._streams.clear()
        finally:
            eng.close_traces()

    def _fail(self, request_ids: list[str], err: BaseException) -> None:
        for rid in request_ids:
            entry = self._streams.pop(rid, None)
            if entry is not None:
                q, loop = entry
                loop.call_soon_threadsafe(q.put_nowait, err)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            a: _Add = cmd[1]
            try:
                self.engine.add_request(a.request_id, a.prompt_token_ids, a.params,
                                        cache_salt=a.cache_salt, session_id=a.session_id,
                                        group=a.group)
            except BaseException as e:  # noqa: BLE001 - the handler re-raises it
                a.loop.call_soon_threadsafe(a.stream.put_nowait, e)
                return
            self._streams[a.request_id] = (a.stream, a.loop)
        elif kind == "abort":
            rid = cmd[1]
            if self.engine.abort(rid):
                log.debug("aborted %s", rid)
            self._streams.pop(rid, None)
        elif kind == "kv_report":
            _, fut, loop = cmd
            report = self.engine.kv_report()
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(report))
        elif kind == "call":
            _, fn, fut, loop = cmd
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 - raised again in the caller's task
                result, error = None, e
            loop.call_soon_threadsafe(_settle, fut, result, error)
        self._snapshot(self.engine)

    def _check_integrity(self, eng: Engine) -> None:
        """With diagnostic faults on, each time the engine goes idle: no KV block leaked
        (`kv_integrity` in /health: "ok" or what broke)."""
        try:
            eng.check_idle_integrity()
            self._kv_integrity = "ok"
        except AssertionError as e:
            log.error("KV cache integrity check failed after a fault: %s", e)
            self._kv_integrity = f"broken: {e}"

    def _snapshot(self, eng: Engine) -> None:
        self._stats = eng.metrics()
        if self._kv_integrity is not None:
            self._stats["kv_integrity"] = self._kv_integrity  # type: ignore[assignment]
        self._routing = eng.routing_counts()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hands a step's outputs to their streams: one wake-up of each event loop per step,
        not one per request (at 16 streams, 16 self-pipe writes and callbacks a step)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            for co in out.outputs:
                if co.metrics is not None:  # a choice's sequence finished
                    for listener in self.finished_listeners:
                        listener(co.metrics)
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue
            q, loop = entry
            if out.finished:
                self._streams.pop(out.request_id, None)
            batches.setdefault(loop, []).append((q, out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # the caller timed out
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def wait_idle(engine: AsyncEngine, timeout: float) -> bool:
    """Blocks until no request is in flight, or the timeout passes. Used by the SIGTERM drain."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if not s.get("num_running") and not s.get("num_waiting") and not engine.num_inflight:
            return True
        time.sleep(0.05)
    return False
