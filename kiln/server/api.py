"""The OpenAI-compatible HTTP API over an AsyncEngine.

    request JSON --protocol.py--> validated request --tokenizer.py--> prompt ids + SamplingParams
      --> one engine request per (prompt, choice) --> _run_choice: detokenize, stop strings,
      logprobs --> _ChoiceEvent --> SSE chunks, or one JSON response

Every error leaves as OpenAI's `{"error": {"message", "type", "param", "code"}}`, and nothing a
client sends can stop the server. Engine requests are aborted whenever their output is no longer
wanted (stop string matched, client disconnected, another choice failed) so KV blocks come back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.errors import KilnError
from kiln.sampling_params import SamplingParams, SamplingParamsError
from kiln.server.protocol import (
    MIN_LOGPROB,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobToken,
    ChatLogprobTop,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    UsageInfo,
    to_sampling_params,
)
from kiln.tokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    Tokenizer,
    TokenizerError,
)

if TYPE_CHECKING:
    from kiln.engine.async_engine import AsyncEngine
    from kiln.engine.request import TokenLogprob

log = logging.getLogger(__name__)

_STATUS_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error with its HTTP status, rendered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _STATUS_TYPES.get(status, "APIError")

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _bad_param(e: SamplingParamsError | TokenizerError, param: str | None = None) -> APIError:
    if isinstance(e, SamplingParamsError):
        code = "context_length_exceeded" if "maximum context length" in e.message else None
        return APIError(400, e.message, param=e.param, code=code or "invalid_value")
    return APIError(400, e.message, param=param, code="invalid_value")


# --------------------------------------------------------------------------------------------
# One choice: engine stream -> text deltas
# --------------------------------------------------------------------------------------------


@dataclass
class _ChoiceEvent:
    """What one engine step (after detokenization and stop strings) adds to one choice."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # where each logprob's token starts
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _ChoiceSpec:
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str = ""  # echoed before the completion when echo=True
    session_id: str | None = None  # keeps this conversation's KV blocks between turns


@dataclass
class _Failed:
    index: int
    error: BaseException


class _Disconnected:
    """Queue sentinel: the client went away, stop waiting for events."""


class _ClientGone(Exception):
    """The client disconnected before the response was ready; nothing is sent."""


class _Fanout:
    """Runs the engine requests of one HTTP request concurrently and merges their events into a
    single queue (in arrival order, each tagged with its choice index)."""

    def __init__(
        self,
        server: _Server,
        specs: list[_ChoiceSpec],
        *,
        cache_salt: str | None,
        include_stop_str: bool,
    ) -> None:
        self.specs = specs
        self.queue: asyncio.Queue[_ChoiceEvent | _Failed | _Disconnected] = asyncio.Queue()
        self.disconnected = False
        loop = asyncio.get_running_loop()
        self._started: list[asyncio.Future[None]] = [loop.create_future() for _ in specs]
        self.tasks = [
            asyncio.create_task(
                self._pump(server, spec, cache_salt, include_stop_str, self._started[i])
            )
            for i, spec in enumerate(specs)
        ]

    async def _pump(
        self,
        server: _Server,
        spec: _ChoiceSpec,
        cache_salt: str | None,
        include_stop_str: bool,
        started: asyncio.Future[None],
    ) -> None:
        def on_started() -> None:
            if not started.done():
                started.set_result(None)

        try:
            async for ev in server.run_choice(spec, cache_salt, include_stop_str, on_started):
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
            raise _ClientGone()

    def cancel(self) -> None:
        """Stop every choice; their engine requests are aborted by run_choice's cleanup."""
        for t in self.tasks:
            t.cancel()

    def disconnect(self) -> None:
        self.disconnected = True
        self.cancel()
        self.queue.put_nowait(_Disconnected())

    async def next(self) -> _ChoiceEvent | _Failed:
        item = await self.queue.get()
        if isinstance(item, _Disconnected):
            raise _ClientGone()
        return item


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    # The body is already read, so the next ASGI message is the disconnect (or it never comes).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


def _clamp(lp: float) -> float:
    return max(MIN_LOGPROB, lp)


class _Server:
    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Tokenizer,
        served_model_names: list[str],
        *,
        max_model_len: int,
        version: str,
        overloaded_error: type[KilnError],
        dead_error: type[KilnError] | None = None,
    ) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model")
        self.engine = engine
        self.tok = tokenizer
        self.names = list(served_model_names)
        self.max_model_len = max_model_len
        self.version = version
        self.overloaded_error = overloaded_error
        self.dead_error = dead_error
        self.created = int(time.time())

    # -- helpers ---------------------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.names[0]
        if model not in self.names:
            raise APIError(
                404,
                f"The model `{model}` does not exist. Served models: {', '.join(self.names)}",
                param="model",
                code="model_not_found",
            )
        return model

    def params_for(
        self, req: ChatCompletionRequest | CompletionRequest, prompt_len: int
    ) -> SamplingParams:
        try:
            return to_sampling_params(req, self.max_model_len, prompt_len)
        except SamplingParamsError as e:
            raise _bad_param(e) from e

    async def run_choice(
        self,
        spec: _ChoiceSpec,
        cache_salt: str | None,
        include_stop_str: bool,
        on_started: Callable[[], None],
    ) -> AsyncIterator[_ChoiceEvent]:
        """Drive one engine request; yield an event per engine step that adds text or logprobs,
        and a final one with finish_reason set. Aborts the engine request on any early exit."""
        params = spec.params
        detok = IncrementalDetokenizer(
            self.tok, spec.prompt_ids, skip_special_tokens=params.skip_special_tokens
        )
        matcher = StopStringMatcher(params.stop, include_stop_str_in_output=include_stop_str)
        want_logprobs = params.logprobs is not None
        consumed = 0  # output tokens taken so far (the engine may run ahead of a stop string)
        done = False
        gen = self.engine.generate(spec.request_id, spec.prompt_ids, params, cache_salt=cache_salt,
                                   session_id=spec.session_id)
        try:
            async for out in gen:
                on_started()
                parts: list[str] = []
                lps: list[TokenLogprob] = []
                offsets: list[int] = []
                stopped = False
                for j, token_id in enumerate(out.new_token_ids):
                    consumed += 1
                    if want_logprobs and out.new_logprobs is not None:
                        lps.append(out.new_logprobs[j])
                        offsets.append(len(detok.text))
                    emit, stopped = matcher.feed(detok.step(token_id))
                    parts.append(emit)
                    if stopped:
                        break
                if not stopped and out.finished:
                    emit, stopped = matcher.feed(detok.flush())
                    parts.append(emit)
                    if not stopped:
                        parts.append(matcher.flush())
                ev = _ChoiceEvent(
                    index=spec.index,
                    text="".join(parts),
                    logprobs=lps,
                    text_offsets=offsets,
                    num_prompt_tokens=len(spec.prompt_ids),
                    num_output_tokens=max(consumed, out.num_output_tokens),
                    num_cached_tokens=out.num_cached_tokens,
                )
                if stopped:
                    # Count only what the client gets: tokens up to the one completing the stop.
                    ev.num_output_tokens = consumed
                    ev.finish_reason = "stop"
                    ev.stop_reason = matcher.stop_reason
                    done = True
                    self.engine.abort(spec.request_id)
                    yield ev
                    return
                if out.finished:
                    ev.finish_reason = out.finish_reason or "stop"
                    stop_token = getattr(out, "stop_token_id", None)
                    if stop_token is not None and stop_token in params.stop_token_ids:
                        ev.stop_reason = stop_token  # vLLM reports which stop token ended it
                    done = True
                    yield ev
                    return
                if ev.text or ev.logprobs:
                    yield ev
            # The engine stream ended without a finished output: treat as aborted.
            done = True
            yield _ChoiceEvent(index=spec.index, text="", finish_reason="abort")
        finally:
            if not done:
                self.engine.abort(spec.request_id)
            aclose = getattr(gen, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # closing must never mask the original outcome
                    log.debug("closing engine stream %s failed", spec.request_id, exc_info=True)

    def chat_logprobs(self, lps: list[TokenLogprob], k: int) -> ChatChoiceLogprobs:
        content: list[ChatLogprobToken] = []
        for lp in lps:
            top = [
                ChatLogprobTop(
                    token=self.tok.token_str(t),
                    logprob=_clamp(v),
                    bytes=list(self.tok.token_bytes(t)),
                )
                for t, v in lp.top[:k]
            ]
            content.append(
                ChatLogprobToken(
                    token=self.tok.token_str(lp.token_id),
                    logprob=_clamp(lp.logprob),
                    bytes=list(self.tok.token_bytes(lp.token_id)),
                    top_logprobs=top,
                )
            )
        return ChatChoiceLogprobs(content=content)

    def completion_logprobs(
        self, lps: list[TokenLogprob], offsets: list[int], k: int, base_offset: int
    ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for lp, off in zip(lps, offsets, strict=True):
            out.tokens.append(self.tok.token_str(lp.token_id))
            out.token_logprobs.append(_clamp(lp.logprob))
            out.top_logprobs.append({self.tok.token_str(t): _clamp(v) for t, v in lp.top[:k]})
            out.text_offset.append(base_offset + off)
        return out

    # -- running a request -------------------------------------------------------------------

    async def start(
        self,
        request: Request,
        specs: list[_ChoiceSpec],
        cache_salt: str | None,
        include_stop_str: bool,
    ) -> _Fanout:
        """Submit every choice and wait until all are admitted; 503 when the engine is full."""
        fan = _Fanout(self, specs, cache_salt=cache_salt, include_stop_str=include_stop_str)
        watcher = asyncio.create_task(_watch_disconnect(request, fan.disconnect))
        try:
            await fan.wait_started()
        except BaseException as e:  # overloaded, client gone, handler cancelled: stop them all
            fan.cancel()
            mapped = self.engine_error(e)
            if mapped is e:
                raise
            raise mapped from e
        finally:
            watcher.cancel()
        return fan

    def engine_error(self, e: BaseException) -> BaseException:
        """The HTTP error for an exception out of the engine (itself when it is not one)."""
        if isinstance(e, self.overloaded_error):
            return APIError(503, e.message, code="overloaded")
        if self.dead_error is not None and isinstance(e, self.dead_error):
            return APIError(503, e.message, code="engine_dead")
        if isinstance(e, KilnError):
            # add_request's own validation (we check the same things first, so rare).
            return APIError(400, e.message, code="invalid_value")
        return e

    async def collect(self, request: Request, fan: _Fanout) -> dict[int, list[_ChoiceEvent]]:
        """Non-streaming: gather all events of all choices (abort on client disconnect)."""
        events: dict[int, list[_ChoiceEvent]] = {s.index: [] for s in fan.specs}
        remaining = len(fan.specs)
        watcher = asyncio.create_task(_watch_disconnect(request, fan.disconnect))
        try:
            while remaining:
                item = await fan.next()
                if isinstance(item, _Failed):
                    err = self.engine_error(item.error)
                    if err is item.error:
                        raise err
                    raise err from item.error
                events[item.index].append(item)
                if item.finished:
                    remaining -= 1
        finally:
            watcher.cancel()
            fan.cancel()
        return events

    async def stream(
        self,
        request: Request,
        fan: _Fanout,
        render: Callable[[_ChoiceEvent], str | None],
        first: list[str],
        last: Callable[[list[_ChoiceEvent]], str | None],
    ) -> AsyncIterator[str]:
        """Streaming: SSE lines for each event; `first` chunks go out before any event; `last`
        gets every choice's final event (for the usage chunk)."""
        # Starlette also cancels this generator on disconnect (ASGI spec < 2.4), but not on every
        # server; our own watcher makes the abort certain either way.
        watcher = asyncio.create_task(_watch_disconnect(request, fan.disconnect))
        finals: list[_ChoiceEvent] = []
        remaining = len(fan.specs)
        try:
            for line in first:
                yield f"data: {line}\n\n"
            while remaining:
                try:
                    item = await fan.next()
                except _ClientGone:
                    return
                if isinstance(item, _Failed):
                    err = self.engine_error(item.error)
                    log.error("request failed mid-stream: %r", err, exc_info=item.error)
                    api_err = (
                        err
                        if isinstance(err, APIError)
                        else APIError(500, f"internal error: {type(err).__name__}: {err}")
                    )
                    yield f"data: {json.dumps(api_err.body())}\n\n"
                    break
                line = render(item)
                if line is not None:
                    yield f"data: {line}\n\n"
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

    # -- endpoints -----------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Any:
        model = self.check_model(req.model)
        kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
        try:
            prompt_ids = self.tok.apply_chat_template(
                req.template_messages(),
                add_generation_prompt=req.add_generation_prompt,
                tools=req.template_tools(),
                continue_final_message=req.continue_final_message,
                **kwargs,
            )
        except TokenizerError as e:
            raise _bad_param(e, "messages") from e
        params = self.params_for(req, len(prompt_ids))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        # A conversation names its session with X-Session-Id, or else OpenAI's `user` field.
        session = request.headers.get("x-session-id") or req.user
        specs = [
            _ChoiceSpec(f"{rid}-{i}", i, prompt_ids, params.for_choice(i),
                        session_id=session if req.n == 1 else None)
            for i in range(req.n)
        ]
        created = int(time.time())
        k = params.logprobs or 0
        fan = await self.start(request, specs, req.cache_salt, req.include_stop_str_in_output)

        def usage(finals: list[_ChoiceEvent]) -> UsageInfo:
            completion = sum(e.num_output_tokens for e in finals)
            cached = max((e.num_cached_tokens for e in finals), default=0)
            return UsageInfo(
                prompt_tokens=len(prompt_ids),
                completion_tokens=completion,
                total_tokens=len(prompt_ids) + completion,
                prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            )

        if not req.stream:
            events = await self.collect(request, fan)
            choices = []
            finals = []
            for i in range(req.n):
                evs = events[i]
                finals.append(evs[-1])
                lps = [lp for e in evs for lp in e.logprobs]
                choices.append(
                    ChatCompletionChoice(
                        index=i,
                        message=ChatResponseMessage(content="".join(e.text for e in evs)),
                        logprobs=self.chat_logprobs(lps, k)
                        if params.logprobs is not None
                        else None,
                        finish_reason=evs[-1].finish_reason,
                        stop_reason=evs[-1].stop_reason,
                    )
                )
            resp = ChatCompletionResponse(
                id=rid, created=created, model=model, choices=choices, usage=usage(finals)
            )
            return JSONResponse(resp.model_dump(mode="json"))

        include_usage = req.include_usage

        def chunk(choices: list[ChatCompletionStreamChoice], u: UsageInfo | None = None) -> str:
            return ChatCompletionChunk(
                id=rid, created=created, model=model, choices=choices, usage=u
            ).model_dump_json()

        def render(ev: _ChoiceEvent) -> str | None:
            if not ev.text and not ev.logprobs and not ev.finished:
                return None
            return chunk(
                [
                    ChatCompletionStreamChoice(
                        index=ev.index,
                        delta=DeltaMessage(content=ev.text) if ev.text else DeltaMessage(),
                        logprobs=(
                            self.chat_logprobs(ev.logprobs, k)
                            if params.logprobs is not None and ev.logprobs
                            else None
                        ),
                        finish_reason=ev.finish_reason,
                        stop_reason=ev.stop_reason,
                    )
                ]
            )

        first = [
            chunk(
                [
                    ChatCompletionStreamChoice(
                        index=i, delta=DeltaMessage(role="assistant", content="")
                    )
                ]
            )
            for i in range(req.n)
        ]

        def last(finals: list[_ChoiceEvent]) -> str | None:
            return chunk([], usage(finals)) if include_usage else None

        return StreamingResponse(
            self.stream(request, fan, render, first, last), media_type="text/event-stream"
        )

    def completion_prompts(self, req: CompletionRequest) -> list[tuple[list[int], str]]:
        out: list[tuple[list[int], str]] = []
        for p in req.prompts():
            if isinstance(p, str):
                ids = self.tok.encode(p, add_special_tokens=True)
                text = p
            else:
                bad = [t for t in p if not 0 <= t < self.tok.vocab_size]
                if bad:
                    raise APIError(
                        400,
                        f"prompt token ids must be in [0, {self.tok.vocab_size}), got {bad[:5]}",
                        param="prompt",
                        code="invalid_value",
                    )
                ids = list(p)
                text = self.tok.decode(ids) if req.echo else ""
            if not ids:
                raise APIError(
                    400, "prompt must not be empty", param="prompt", code="invalid_value"
                )
            out.append((ids, text))
        return out

    async def completion(self, req: CompletionRequest, request: Request) -> Any:
        model = self.check_model(req.model)
        prompts = self.completion_prompts(req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        specs: list[_ChoiceSpec] = []
        for pi, (ids, text) in enumerate(prompts):
            params = self.params_for(req, len(ids))
            for i in range(req.n):
                idx = pi * req.n + i  # OpenAI's numbering for a batch of prompts
                specs.append(_ChoiceSpec(f"{rid}-{idx}", idx, ids, params.for_choice(i), text))
        want_lp = req.logprobs is not None
        k = req.logprobs or 0
        created = int(time.time())
        fan = await self.start(request, specs, req.cache_salt, req.include_stop_str_in_output)

        def usage(finals: list[_ChoiceEvent]) -> UsageInfo:
            prompt_tokens = sum(len(ids) for ids, _ in prompts)
            completion = sum(e.num_output_tokens for e in finals)
            cached_by_prompt: dict[int, int] = {}
            for e in finals:
                pi = e.index // req.n
                cached_by_prompt[pi] = max(cached_by_prompt.get(pi, 0), e.num_cached_tokens)
            return UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion,
                total_tokens=prompt_tokens + completion,
                prompt_tokens_details=PromptTokensDetails(
                    cached_tokens=sum(cached_by_prompt.values())
                ),
            )

        echo_len = {s.index: len(s.prompt_text) if req.echo else 0 for s in specs}

        if not req.stream:
            events = await self.collect(request, fan)
            choices = []
            finals = []
            for s in specs:
                evs = events[s.index]
                finals.append(evs[-1])
                text = (s.prompt_text if req.echo else "") + "".join(e.text for e in evs)
                lps = [lp for e in evs for lp in e.logprobs]
                offs = [o for e in evs for o in e.text_offsets]
                choices.append(
                    CompletionChoice(
                        index=s.index,
                        text=text,
                        logprobs=(
                            self.completion_logprobs(lps, offs, k, echo_len[s.index])
                            if want_lp
                            else None
                        ),
                        finish_reason=evs[-1].finish_reason,
                        stop_reason=evs[-1].stop_reason,
                    )
                )
            resp = CompletionResponse(
                id=rid, created=created, model=model, choices=choices, usage=usage(finals)
            )
            return JSONResponse(resp.model_dump(mode="json"))

        include_usage = req.include_usage

        def chunk(choices: list[CompletionChoice], u: UsageInfo | None = None) -> str:
            return CompletionChunk(
                id=rid, created=created, model=model, choices=choices, usage=u
            ).model_dump_json()

        def render(ev: _ChoiceEvent) -> str | None:
            if not ev.text and not ev.logprobs and not ev.finished:
                return None
            lp = (
                self.completion_logprobs(ev.logprobs, ev.text_offsets, k, echo_len[ev.index])
                if want_lp and ev.logprobs
                else None
            )
            return chunk(
                [
                    CompletionChoice(
                        index=ev.index,
                        text=ev.text,
                        logprobs=lp,
                        finish_reason=ev.finish_reason,
                        stop_reason=ev.stop_reason,
                    )
                ]
            )

        first = (
            [
                chunk([CompletionChoice(index=s.index, text=s.prompt_text)])
                for s in specs
                if s.prompt_text
            ]
            if req.echo
            else []
        )

        def last(finals: list[_ChoiceEvent]) -> str | None:
            return chunk([], usage(finals)) if include_usage else None

        return StreamingResponse(
            self.stream(request, fan, render, first, last), media_type="text/event-stream"
        )


# --------------------------------------------------------------------------------------------
# App
# --------------------------------------------------------------------------------------------


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    # loc = ("body", "messages", 0, "content", ...): the top-level field is the OpenAI param.
    parts = [p for p in loc if p != "body"]
    return str(parts[0]) if parts and isinstance(parts[0], str) else None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        why = detail.get("ctx", {}).get("error", detail.get("msg", ""))
        return APIError(400, f"Malformed JSON in the request body: {why}", code="invalid_json")
    if not errors:
        return APIError(400, "invalid request", code="invalid_value")
    first = errors[0]
    param = _validation_param(tuple(first.get("loc", ())))
    if param is None and len(tuple(first.get("loc", ()))) <= 1:
        # The body itself is missing or not an object.
        return APIError(400, f"Invalid request body: {first.get('msg')}", code="invalid_value")
    # Only the errors about the same top-level field, so a union's alternatives don't drown it.
    same = [e for e in errors if _validation_param(tuple(e.get("loc", ()))) == param]
    # Our own "not supported" checks are value errors; they beat a union's "not a string".
    ours = [e for e in same if e.get("type") == "value_error"]
    msgs = []
    for e in ours or same:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        msgs.append(f"{where}: {msg}")
    return APIError(400, "; ".join(dict.fromkeys(msgs[:4])), param=param, code="invalid_value")


def build_app(
    engine: AsyncEngine,
    tokenizer: Tokenizer,
    served_model_names: list[str],
    *,
    api_key: str | None,
    max_model_len: int,
    version: str,
) -> FastAPI:
    """The FastAPI app serving `engine` under every name in `served_model_names` (first is the
    primary; an omitted `model` means it). With `api_key`, /v1/* needs `Authorization: Bearer`."""
    from kiln.engine import async_engine

    server = _Server(
        engine,
        tokenizer,
        served_model_names,
        max_model_len=max_model_len,
        version=version,
        overloaded_error=async_engine.EngineOverloadedError,
        dead_error=getattr(async_engine, "EngineDeadError", None),
    )
    app = FastAPI(title="kiln", version=version, docs_url=None, redoc_url=None)
    app.state.kiln = server

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError(
                401,
                "Missing or invalid API key: send `Authorization: Bearer <key>`",
                code="invalid_api_key",
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        try:
            return await server.chat(req, request)
        except _ClientGone:
            return Response(status_code=499)  # nginx's "client closed request"; never delivered

    @v1.post("/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        try:
            return await server.completion(req, request)
        except _ClientGone:
            return Response(status_code=499)

    @v1.get("/models")
    async def models() -> Any:
        cards = [
            ModelCard(
                id=name,
                created=server.created,
                root=server.names[0],
                max_model_len=max_model_len,
            )
            for name in server.names
        ]
        return JSONResponse(ModelList(data=cards).model_dump(mode="json"))

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Any:
        try:
            stats = dict(engine.stats())
        except Exception as e:  # noqa: BLE001 - a dead engine thread shows here
            return JSONResponse({"status": "error", "error": str(e)}, status_code=503)
        return JSONResponse({"status": "ok", **stats})

    @app.get("/version")
    async def get_version() -> Any:
        return JSONResponse({"version": version})

    @app.get("/metrics")
    async def metrics() -> Any:
        from kiln.server.metrics import render

        return Response(render(engine.stats(), server.names[0]),
                        media_type="text/plain; version=0.0.4")

    return app
