"""The audio models' thread: one model, built and run on its own thread, one job at a time.

    route --AudioWorker.stream(job)--> jobs queue --> model thread: job() is an iterator
      (segments of a transcript, sentences of speech); each item as it comes
      --loop.call_soon_threadsafe--> the request's asyncio queue --> the route (JSON or SSE)

Why not the generation engine or the embedder's loop: a Whisper or Piper model is run by its own
runtime (CTranslate2, onnxruntime) that threads its own kernels and batches nothing across
requests here, so what kiln adds is only the thread that keeps the event loop free, a bounded
queue (503 past --max-queue) and stopping a job whose client went away (between items).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import KilnError

log = logging.getLogger("kiln.audio")

_END = object()  # the job's iterator is exhausted


class AudioOverloadedError(KilnError):
    """Too many requests are waiting: the server answers 503."""


@dataclass
class _Job:
    run: Callable[[Any], Iterator[Any]]  # called with the model on the model thread
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    cancelled: bool = False


class AudioWorker:
    """Quacks like AsyncEngine where the app reads it (stats, routing_stats,
    finished_listeners, num_inflight, shutdown)."""

    def __init__(self, factory: Callable[[], Any], *, max_queue: int = 1024,
                 name: str = "kiln-audio") -> None:
        self._factory = factory
        self.model: Any = None
        self.max_queue = max_queue
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._waiting = 0  # jobs accepted and not yet started (both threads, under _lock)
        self._lock = threading.Lock()
        self._built = threading.Event()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._stats: dict[str, float] = {"num_running": 0, "requests": 0, "busy_seconds": 0.0}
        self.finished_listeners: list[Callable[[Any], None]] = []
        self.num_inflight = 0

    def start(self, wait: bool = True) -> AudioWorker:
        self._thread.start()
        if wait:
            self.wait_built()
        return self

    def wait_built(self) -> Any:
        self._built.wait()
        if self.model is None:
            assert self._dead is not None
            raise self._dead
        return self.model

    def shutdown(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    def stats(self) -> dict[str, float]:
        if self._dead is not None:
            raise RuntimeError(f"audio model stopped: {self._dead}")
        return {**self._stats, "num_waiting": self._waiting, "num_inflight": self.num_inflight}

    def routing_stats(self) -> dict[int, list[int]]:
        return {}

    async def kv_report(self) -> dict[str, Any]:
        """/debug/kv: an audio model keeps no KV cache of kiln's."""
        return {"integrity": "ok", "blocks_total": 0, "num_running": self._stats["num_running"],
                "num_waiting": self._waiting, "note": "an audio model: no KV cache"}

    async def stream(self, run: Callable[[Any], Iterator[Any]]) -> AsyncIterator[Any]:
        """The items `run(model)` yields on the model thread, as they come; its exception is
        raised here. Leaving the loop early (client gone) stops the job at its next item."""
        with self._lock:
            if self._waiting >= self.max_queue:
                raise AudioOverloadedError(f"{self._waiting} requests are waiting "
                                           f"(--max-queue {self.max_queue})")
            self._waiting += 1
        job = _Job(run, asyncio.get_running_loop())
        self.num_inflight += 1
        self._jobs.put(job)
        try:
            while True:
                item = await job.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            job.cancelled = True
            self.num_inflight -= 1

    # ---------------------------------------------------------------- model thread

    def _main(self) -> None:
        try:
            self.model = self._factory()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            self._dead = e
        finally:
            self._built.set()
        if self.model is None:
            return
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._waiting -= 1
            if job.cancelled:
                continue
            self._stats["num_running"] = 1
            t0 = time.perf_counter()
            try:
                for item in job.run(self.model):
                    job.loop.call_soon_threadsafe(job.out.put_nowait, item)
                    if job.cancelled:
                        break
                job.loop.call_soon_threadsafe(job.out.put_nowait, _END)
            except Exception as e:  # the request's error (bad audio, bad text), not the thread's
                log.debug("audio job failed", exc_info=e)
                job.loop.call_soon_threadsafe(job.out.put_nowait, e)
            finally:
                self._stats["num_running"] = 0
                self._stats["requests"] += 1
                self._stats["busy_seconds"] += time.perf_counter() - t0
