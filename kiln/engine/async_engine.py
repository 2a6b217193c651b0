"""AsyncEngine: the engine loop on its own thread, one async stream per request.

    HTTP handlers (event loop)                      engine thread
    ----------------------------                    ---------------------------------
    generate() -> commands.put(("add", ...))  --->  drain commands, engine.step()
    async for out in stream  <--- loop.call_soon_threadsafe(queue.put_nowait, out)
    (client gone) -> abort() -> commands.put  --->  engine.abort(): blocks freed at once

The thread sleeps on the command queue when there is no work (no busy spin). Every call into the
`Engine` happens on the engine thread, so the engine itself needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kiln.engine.engine import Engine, RequestOutput
from kiln.errors import KilnError
from kiln.sampling_params import SamplingParams

log = logging.getLogger("kiln.async_engine")


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


class AsyncEngine:
    def __init__(self, engine: Engine, *, max_queue: int = 1024,
                 eos_token_ids: set[int] | None = None) -> None:
        """`eos_token_ids`: every id that ends a turn (the tokenizer knows more of them than the
        model config, e.g. both <|endoftext|> and <|im_end|>)."""
        self.engine = engine
        self.eos_token_ids = (set(eos_token_ids or ()) | set(engine.eos_token_ids)) or None
        self.max_queue = max_queue
        self._commands: queue.Queue[Any] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._stats: dict[str, float] = engine.metrics()
        self._stop = threading.Event()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self.num_inflight = 0

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)

    # ------------------------------------------------------------------ request side

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, *, cache_salt: str | None = None,
                       session_id: str | None = None) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        if self._stats.get("num_waiting", 0) >= self.max_queue:
            raise EngineOverloadedError(
                f"the server is overloaded: {int(self._stats['num_waiting'])} requests waiting",
                hint="retry later, or raise --max-queue")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        cmd = _Add(request_id, prompt_token_ids, params, cache_salt, stream, loop, session_id)
        self._commands.put(("add", cmd))
        # Validation errors (prompt too long, bad token id) come back before any output.
        first = await stream.get()
        if isinstance(first, BaseException):
            raise first
        self.num_inflight += 1
        finished = False
        try:
            item = first
            while True:
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
                item = await stream.get()
        finally:
            self.num_inflight -= 1
            if not finished:
                self.abort(request_id)  # the consumer went away: free the blocks now

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stats(self) -> dict[str, float]:
        s = dict(self._stats)
        s["num_inflight"] = self.num_inflight
        return s

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                block = not eng.has_unfinished
                self._drain(block)
                if not eng.has_unfinished and not eng._outputs_pending:
                    self._stats = eng.metrics()
                    continue
                outputs = eng.step()
                for out in outputs:
                    self._deliver(out)
                self._stats = eng.metrics()
        except BaseException as e:  # noqa: BLE001 - report to every waiter, then stop
            log.exception("engine loop crashed")
            self._dead = e
            for q, loop in list(self._streams.values()):
                loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"engine crashed: {e}"))
            self._streams.clear()

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
                                        cache_salt=a.cache_salt, session_id=a.session_id)
            except BaseException as e:  # noqa: BLE001 - the handler re-raises it
                a.loop.call_soon_threadsafe(a.stream.put_nowait, e)
                return
            self._streams[a.request_id] = (a.stream, a.loop)
        elif kind == "abort":
            rid = cmd[1]
            if self.engine.abort(rid):
                log.debug("aborted %s", rid)
            self._streams.pop(rid, None)
        self._stats = self.engine.metrics()

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._streams.get(out.request_id)
        if entry is None:
            return
        q, loop = entry
        if out.finished:
            self._streams.pop(out.request_id, None)
        loop.call_soon_threadsafe(q.put_nowait, out)


def wait_idle(engine: AsyncEngine, timeout: float) -> bool:
    """Blocks until no request is in flight, or the timeout passes. Used by the SIGTERM drain."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if not s.get("num_running") and not s.get("num_waiting") and not engine.num_inflight:
            return True
        time.sleep(0.05)
    return False
