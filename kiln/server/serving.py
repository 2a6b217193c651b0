"""What every generating route shares: the served names, turning a request into engine requests
(one per prompt and choice), and carrying their outputs back, whole or as SSE.

    route --specs--> Serving.start: one engine request per choice, all admitted (or 503) before
      any header is sent --> Fanout merges their outputs (tagged with the choice index)
      --> Serving.collect (one JSON response) or Serving.stream (SSE lines)

Text, stop strings, EOS and logprobs were already decided by the engine's output processor
(kiln/engine/output.py), the same one the offline LLM and `kiln run` read. Engine requests are
aborted whenever their output is no longer wanted (client gone, another choice failed), so their
KV blocks come back at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from kiln.sampling_params import SamplingParams, SamplingParamsError
from kiln.server.errors import APIError, ClientGone, bad_param, engine_error
from kiln.server.protocol import (
    MIN_LOGPROB,
    ChatCompletionRequest,
    CompletionRequest,
    RequestLimits,
    structured_outputs_of,
    to_sampling_params,
)
from kiln.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kiln.engine.async_engine import AsyncEngine
    from kiln.engine.request import TokenLogprob
    from kiln.obs.dump import RequestDump, RequestDumper
    from kiln.obs.faults import Faults

log = logging.getLogger(__name__)


@dataclass
class ChoiceEvent:
    """What one engine step added to one choice."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # where each logprob's token starts
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # the new output token ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @staticmethod
    def joined(evs: list[ChoiceEvent]) -> ChoiceEvent:
        """A choice's events as one: all its text, logprobs and offsets (offsets already count
        from the choice's start); reasons and token counts are the last event's, the totals."""
        return replace(evs[-1], text="".join(e.text for e in evs),
                       token_ids=[t for e in evs for t in e.token_ids],
                       logprobs=[lp for e in evs for lp in e.logprobs],
                       text_offsets=[o for e in evs for o in e.text_offsets])


@dataclass
class ChoiceSpec:
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str = ""  # echoed before the completion when echo=True
    session_id: str | None = None  # keeps this conversation's KV blocks between turns
    cache_salt: str | None = None


@dataclass
class _Failed:
    index: int
    error: BaseException


class StreamDropped(Exception):
    """--diagnostic-fault drop_stream: raised out of the SSE body, so the server cuts the
    connection mid-response (the client sees a stream end without [DONE])."""


class _Disconnected:
    """Queue sentinel: the client went away, stop waiting for events."""


def clamp_logprob(lp: float) -> float:
    return max(MIN_LOGPROB, lp)


class Serving:
    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, served_model_names: list[str],
                 *, max_model_len: int, version: str, limits: RequestLimits | None = None,
                 dumper: RequestDumper | None = None, faults: Faults | None = None) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model")
        self.engine = engine
        self.tok = tokenizer
        self.names = list(served_model_names)
        self.max_model_len = max_model_len
        self.version = version
        self.limits = limits or RequestLimits()
        self.created = int(time.time())
        self.dumper = dumper
        self.faults = faults

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.names[0]
        if model not in self.names:
            raise APIError(404, f"The model `{model}` does not exist. Served models: "
                           f"{', '.join(self.names)}", param="model", code="model_not_found")
        return model

    def params_for(self, req: ChatCompletionRequest | CompletionRequest, prompt_len: int
                   ) -> SamplingParams:
        try:
            return to_sampling_params(req, self.max_model_len, prompt_len, self.limits)
        except SamplingParamsError as e:
            raise bad_param(e) from e

    async def check_structured(self, req: ChatCompletionRequest | CompletionRequest,
                               params: SamplingParams) -> None:
        """Compiles the request's output constraint (or finds it in the engine's cache) before
        admission, so an invalid schema, regex or grammar is a 400 naming its field. On a worker
        thread: a first compile can take milliseconds, the grammar vocabulary ~0.5 s once."""
        so = params.structured_outputs
        if so is None:
            return
        found = structured_outputs_of(req)
        param = found[1] if found is not None else "structured_outputs"
        grammars = self.engine.structured
        if grammars is None:
            raise APIError(400, "structured output needs the model's tokenizer, and this engine "
                           "has none", param=param, code="invalid_value")
        try:
            await asyncio.to_thread(grammars.compile, so, param)
        except SamplingParamsError as e:
            raise bad_param(e) from e

    async def run_choice(self, spec: ChoiceSpec, on_started: Callable[[], None]
                         ) -> AsyncIterator[ChoiceEvent]:
        """One engine request as events: one per step that adds text or logprobs, and a final
        one with finish_reason set. Aborts the engine request on any early exit."""
        done = False
        gen = self.engine.generate(spec.request_id, spec.prompt_ids, spec.params,
                                   cache_salt=spec.cache_salt, session_id=spec.session_id)
        try:
            async for out in gen:
                on_started()
                ev = ChoiceEvent(
                    index=spec.index, text=out.text, logprobs=out.new_logprobs or [],
                    text_offsets=out.text_offsets,
                    finish_reason=(out.finish_reason or "stop") if out.finished else None,
                    stop_reason=out.stop_reason, num_prompt_tokens=out.num_prompt_tokens,
                    num_output_tokens=out.num_output_tokens,
                    num_cached_tokens=out.num_cached_tokens, token_ids=out.new_token_ids)
                if ev.finished:
                    done = True
                    yield ev
                    return
                if ev.text or ev.logprobs or ev.token_ids:
                    yield ev
            # The engine stream ended without a finished output: treat as aborted.
            done = True
            yield ChoiceEvent(index=spec.index, text="", finish_reason="abort")
        finally:
            if not done:
                self.engine.abort(spec.request_id)
            try:
                await gen.aclose()
            except Exception:  # closing must never mask the original outcome
                log.debug("closing engine stream %s failed", spec.request_id, exc_info=True)

    async def start(self, request: Request, specs: list[ChoiceSpec], body: Any = None
                    ) -> Fanout:
        """Submit every choice and wait until all are admitted; 503 when the engine is full.
        `body` (the validated request) goes into the request dump, when one is written."""
        fan = Fanout(self, specs)
        if self.dumper is not None and body is not None:
            fan.dump = self.dumper.begin(request.url.path.removeprefix("/v1/"), body, specs)
        watcher = asyncio.create_task(_watch_disconnect(request, fan.disconnect))
        try:
            await fan.wait_started()
        except BaseException as e:  # overloaded, client gone, handler cancelled: stop them all
            fan.cancel()
            if fan.dump is not None:
                fan.dump.write(error=f"{type(e).__name__}: {e}")
            mapped = engine_error(e)
            if mapped is e:
                raise
            raise mapped from e
        finally:
            watcher.cancel()
        return fan

    async def collect(self, request: Request, fan: Fanout) -> dict[int, ChoiceEvent]:
        """Non-streaming: gather all events of all choices (abort on client disconnect), each
        choice's joined into one (`ChoiceEvent.joined`), in the order of `fan.specs`."""
        events: dict[int, list[ChoiceEvent]] = {s.index: [] for s in fan.specs}
        remaining = len(fan.specs)
        watcher = asyncio.create_task(_watch_disconnect(request, fan.disconnect))
        try:
            while remaining:
                item = await fan.next()
                if isinstance(item, _Failed):
                    if fan.dump is not None:
                        fan.dump.write(error=str(item.error))
                    err = engine_error(item.error)
                    if err is item.error:
                        raise err
                    raise err from item.error
                events[item.index].append(item)
                if fan.dump is not None:
                    fan.dump.add(item)
                if item.finished:
                    remaining -= 1
        finally:
            watcher.cancel()
            fan.cancel()
        if fan.dump is not None:
            fan.dump.write()
        return {i: ChoiceEvent.joined(evs) for i, evs in events.items()}

    def stream_response(self, request: Request, fan: Fanout,
                        render: Callable[[ChoiceEvent], str], first: list[str],
                        last: Callable[[list[ChoiceEvent]], str | None]) -> StreamingResponse:
        """`stream` as the SSE response a streaming route returns."""
        return StreamingResponse(self.stream(request, fan, render, first, last),
                                 media_type="text/event-stream")

    async def stream(self, request: Request, fan: Fanout,
                     render: Callable[[ChoiceEvent], str], first: list[str],
                     last: Callable[[list[ChoiceEvent]], str | None]) -> AsyncIterator[str]:
        """Streaming: SSE lines for each event that says something (`render` makes its chunk);
        `first` chunks go out before any event; `last` gets every choice's final event (for the
        usage chunk)."""
        # Starlette also cancels this generator on disconnect (ASGI spec < 2.4), but not on every
        # server; our own watcher makes the abort certain either way.
        watcher = asyncio.create_task(_watch_disconnect(request, fan.disconnect))
        finals: list[ChoiceEvent] = []
        remaining = len(fan.specs)
        dump = fan.dump
        error: str | None = None
        # --diagnostic-fault drop_stream:N: this stream is cut after N chunks (a drill).
        drop_after = self.faults.take_drop_stream() if self.faults is not None else None
        sent = 0
        try:
            for line in first:
                yield f"data: {line}\n\n"
            while remaining:
                if drop_after is not None and sent >= drop_after:
                    log.warning("stream cut after %d chunks by --diagnostic-fault drop_stream",
                                sent)
                    error = f"dropped by --diagnostic-fault drop_stream:{drop_after}"
                    fan.disconnect()  # as when the client leaves: its requests are aborted
                    raise StreamDropped(error)
                try:
                    item = await fan.next()
                except ClientGone:
                    error = "client disconnected"  # the dump keeps the partial output
                    return
                if isinstance(item, _Failed):
                    error = str(item.error)
                    err = engine_error(item.error)
                    log.error("request failed mid-stream: %r", err, exc_info=item.error)
                    api_err = err if isinstance(err, APIError) else APIError(
                        500, f"internal error: {type(err).__name__}: {err}")
                    yield f"data: {json.dumps(api_err.body())}\n\n"
                    break
                if dump is not None:
                    dump.add(item)
                # A step that added no text or logprobs and finished nothing has nothing to send.
                if item.text or item.logprobs or item.finished:
                    yield f"data: {render(item)}\n\n"
                    sent += 1
                if item.finished:
                    finals.append(item)
                    remaining -= 1
            if not remaining:
                tail = last(finals)
                if tail is not None:
                    yield f"data: {tail}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            fan.cancel()
            if dump is not None:
                dump.write(error=error)


class Fanout:
    """Runs the engine requests of one HTTP request concurrently and merges their events into a
    single queue (in arrival order, each tagged with its choice index)."""

    def __init__(self, serving: Serving, specs: list[ChoiceSpec]) -> None:
        self.specs = specs
        self.queue: asyncio.Queue[ChoiceEvent | _Failed | _Disconnected] = asyncio.Queue()
        self.disconnected = False
        self.dump: RequestDump | None = None  # --request-dump-dir
        loop = asyncio.get_running_loop()
        self._started: list[asyncio.Future[None]] = [loop.create_future() for _ in specs]
        self.tasks = [asyncio.create_task(self._pump(serving, spec, self._started[i]))
                      for i, spec in enumerate(specs)]

    async def _pump(self, serving: Serving, spec: ChoiceSpec, started: asyncio.Future[None]
                    ) -> None:
        def on_started() -> None:
            if not started.done():
                started.set_result(None)

        try:
            async for ev in serving.run_choice(spec, on_started):
                await self.queue.put(ev)
        except Exception as e:  # noqa: BLE001 - surfaced to the handler via the queue / future
            if not started.done():
                started.set_exception(e)
            await self.queue.put(_Failed(spec.index, e))
        finally:
            on_started()

    async def wait_started(self) -> None:
        """Wait until every choice was admitted by the engine (its first output arrived) or one
        failed; a failure (e.g. EngineOverloadedError) is raised here, before any header is sent,
        so it can still become a proper HTTP status."""
        try:
            for fut in self._started:
                await fut
        finally:
            for fut in self._started:  # a second failure is not worth an "unretrieved" warning
                if fut.done() and not fut.cancelled():
                    fut.exception()
        if self.disconnected:
            raise ClientGone()

    def cancel(self) -> None:
        """Stop every choice; their engine requests are aborted by run_choice's cleanup."""
        for t in self.tasks:
            t.cancel()

    def disconnect(self) -> None:
        self.disconnected = True
        self.cancel()
        self.queue.put_nowait(_Disconnected())

    async def next(self) -> ChoiceEvent | _Failed:
        item = await self.queue.get()
        if isinstance(item, _Disconnected):
            raise ClientGone()
        return item


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    # The body is already read, so the next ASGI message is the disconnect (or it never comes).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return
