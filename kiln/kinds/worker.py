"""The audio models' threads: one model per slot, each built and run on its own thread, one job
at a time per slot (one slot unless --tts-slots asks for more: ferrum's concurrent speech).

    route --AudioWorker.stream(job)--> jobs queue --> a free slot's thread: job() is an iterator
      (segments of a transcript, sentences of speech); each item as it comes
      --loop.call_soon_threadsafe--> the request's asyncio queue --> the route (JSON or SSE)

Why not the generation engine or the embedder's loop: a Whisper or Piper model is run by its own
runtime (CTranslate2, onnxruntime) that threads its own kernels and batches nothing across
requests here, so what kiln adds is only the thread that keeps the event loop free, a bounded
queue (503 past --max-queue) and stopping a job whose client went away (between items). Several
slots run several jobs at once, each on its own copy of the model (an onnxruntime session's
threads serve one run at a time well; two runs sharing one session's pool contend).
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
    finished_listeners, num_inflight, shutdown). `factory` is called once per slot, on that
    slot's thread; `model` is the first slot's (what the startup banner describes)."""

    def __init__(self, factory: Callable[[], Any], *, max_queue: int = 1024,
                 name: str = "kiln-audio", slots: int = 1) -> None:
        self._factory = factory
        self.model: Any = None
        self.max_queue = max_queue
        self.slots = max(1, slots)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._waiting = 0  # jobs accepted and not yet started (all threads, under _lock)
        self._unbuilt = self.slots  # slots still building their model (under _lock)
        self._lock = threading.Lock()
        self._built = threading.Event()  # every slot built, or one failed
        self._dead: BaseException | None = None
        self._threads = [threading.Thread(target=self._main, args=(i,), daemon=True,
                                          name=name if self.slots == 1 else f"{name}-{i}")
                         for i in range(self.slots)]
        self._stats: dict[str, float] = {"num_running": 0, "requests": 0, "busy_seconds": 0.0}
        self.finished_listeners: list[Callable[[Any], None]] = []
        self.num_inflight = 0

    def start(self, wait: bool = True) -> AudioWorker:
        for t in self._threads:
            t.start()
        if wait:
            self.wait_built()
        return self

    def wait_built(self) -> Any:
        """The first slot's model once every slot has built its own; a slot's failure is
        raised here (the server does not start with fewer slots than asked)."""
        self._built.wait()
        if self._dead is not None:
            raise self._dead
        return self.model

    def shutdown(self, timeout: float = 5.0) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout)

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

    def _main(self, slot: int) -> None:
        model = None
        try:
            model = self._factory()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            self._dead = self._dead or e
        finally:
            with self._lock:
                if slot == 0:
                    self.model = model
                self._unbuilt -= 1
                if model is None or self._unbuilt == 0:
                    self._built.set()
        if model is None:
            return
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._waiting -= 1
                if not job.cancelled:
                    self._stats["num_running"] += 1
            if job.cancelled:
                continue
            t0 = time.perf_counter()
            try:
                for item in job.run(model):
                    job.loop.call_soon_threadsafe(job.out.put_nowait, item)
                    if job.cancelled:
                        break
                job.loop.call_soon_threadsafe(job.out.put_nowait, _END)
            except Exception as e:  # the request's error (bad audio, bad text), not the thread's
                log.debug("audio job failed", exc_info=e)
                job.loop.call_soon_threadsafe(job.out.put_nowait, e)
            finally:
                with self._lock:
                    self._stats["num_running"] -= 1
                    self._stats["requests"] += 1
                    self._stats["busy_seconds"] += time.perf_counter() - t0
