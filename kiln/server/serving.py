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
from kiln.server.chat_output import ChatFormat
from kiln.server.errors import APIError, ClientGone, bad_param, engine_error
from kiln.server.protocol import (
    MIN_LOGPROB,
    ChatCompletionRequest,
    CompletionRequest,
    PromptLogprob,
    PromptLogprobs,
)
from kiln.server.request_params import (
    RequestLimits,
    check_limits,
    structured_outputs_of,
    to_sampling_params,
)
from kiln.tokenizer import (
    Tokenizer,
    TokenizerError,
    coalesce_system_messages,
    has_interleaved_system,
)

if TYPE_CHECKING:
    from kiln.engine.async_engine import AsyncEngine
    from kiln.engine.request import TokenLogprob
    from kiln.kinds.embedding import EmbeddingEngine
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
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a choice's first event

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @staticmethod
    def joined(evs: list[ChoiceEvent]) -> ChoiceEvent:
        """A choice's events as one: all its text, logprobs and offsets (offsets already count
        from the choice's start); reasons and token counts are the last event's, the totals."""
        return replace(evs[-1], text="".join(e.text for e in evs),
                       prompt_logprobs=next((e.prompt_logprobs for e in evs
                                             if e.prompt_logprobs is not None), None),
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


# "an ..." before each
_KIND_NAME = {"generate": "LLM (text generating)", "embed": "embedding",
              "transcribe": "audio transcription", "speech": "audio speech"}


def data_frame(chunk: str) -> str:
    """One SSE event carrying `chunk` (a JSON text) as its data."""
    return f"data: {chunk}\n\n"


def clamp_logprob(lp: float) -> float:
    return max(MIN_LOGPROB, lp)


def prompt_logprobs_json(tok: Tokenizer, lps: list[TokenLogprob | None] | None
                         ) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs: None for the first token, then {token id: logprob, rank,
    decoded_token} for the prompt's token and the k likeliest."""
    if lps is None:
        return None
    out: PromptLogprobs = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank,
                                                 decoded_token=tok.token_str(lp.token_id))}
        for rank, (t, v) in enumerate(lp.top, start=1):
            entry.setdefault(str(t), PromptLogprob(logprob=clamp_logprob(v), rank=rank,
                                                   decoded_token=tok.token_str(t)))
        out.append(entry)
    return out


class Serving:
    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, served_model_names: list[str],
                 *, max_model_len: int, version: str, limits: RequestLimits | None = None,
                 dumper: RequestDumper | None = None, faults: Faults | None = None,
                 kind: str = "generate", embedder: EmbeddingEngine | None = None,
                 coalesce_system: bool = False, chat: ChatFormat | None = None
                 ) -> None:
        """`kind`: what the model serves (kiln/kinds/): the generating routes refuse an
        embedding model, /v1/embeddings a generating one; `embedder` runs /v1/embeddings.
        `coalesce_system`: --enable-interleaved-system-coalescing (see `chat_prompt`);
        `chat`: tool-call / reasoning parsers, enable_thinking."""
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
        self.kind = kind
        self.embedder = embedder
        self.coalesce_system = coalesce_system
        self.chat = chat or ChatFormat()  # tool-call / reasoning parsers, enable_thinking
        # LoRA adapters served (kiln/server/routes/lora.py): model id -> (adapter name, path)
        self.adapters: dict[str, tuple[str, str]] = {}
        self.lora_template = "<name>"  # --lora-model-id-template

    def adapter_model_id(self, name: str) -> str:
        return self.lora_template.replace("<base>", self.names[0]).replace("<name>", name)

    def add_adapter(self, name: str, path: str) -> None:
        self.adapters[self.adapter_model_id(name)] = (name, path)

    def remove_adapter(self, name: str) -> None:
        self.adapters.pop(self.adapter_model_id(name), None)

    def check_model(self, model: str | None, kind: str = "generate") -> str:
        """The served name `model` asks for; refuses (400) a request for another kind of model
        than the one served (chat on an embedding model, embeddings on a chat model)."""
        if kind != self.kind:
            from kiln.kinds import ENDPOINTS

            how = (" Restart it with `--kind embed` to embed with this model's hidden states "
                   "(a decoder as embedder: last-token pooling, as Qwen3-Embedding)"
                   if kind == "embed" and self.kind == "generate" else "")
            raise APIError(400, f"`{self.names[0]}` is served as an {_KIND_NAME[self.kind]} "
                           f"model (--kind {self.kind}): it answers {ENDPOINTS[self.kind]}, not "
                           f"{_KIND_NAME[kind]} requests.{how}", param="model",
                           code="wrong_model_kind")
        if model is None:
            return self.names[0]
        if model not in self.names and model not in self.adapters:
            raise APIError(404, f"The model `{model}` does not exist. Served models: "
                           f"{', '.join([*self.names, *self.adapters])}", param="model",
                           code="model_not_found")
        return model

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token spelled `text` (a tool-call marker such as Mistral's
        [TOOL_CALLS]), or None when no single special token is."""
        ids = self.tok.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and ids[0] in self.tok.all_special_ids else None

    def chat_prompt(self, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
        """Token ids of a conversation through the chat template (see `chat_prompt_text`)."""
        # The template already writes BOS/role tokens; adding special tokens again would double BOS.
        return self.tok.encode(self.chat_prompt_text(messages, **kw), add_special_tokens=False)

    def chat_prompt_text(self, messages: list[dict[str, Any]], *,
                         tools: list[dict[str, Any]] | None = None,
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         template_kwargs: dict[str, Any] | None = None, param: str = "messages"
                         ) -> str:
        """A conversation through the chat template: what chat completions, /v1/responses and
        /tokenize all render. --enable-thinking/--disable-thinking is the template's
        enable_thinking unless the request's kwargs set it. With
        --enable-interleaved-system-coalescing the system messages are first merged into one at
        the start; without it a template that refuses them is a 400 that names the flag."""
        kwargs = dict(template_kwargs or {})
        if self.chat.enable_thinking is not None:
            kwargs.setdefault("enable_thinking", self.chat.enable_thinking)
        if self.coalesce_system:
            messages = coalesce_system_messages(messages)
        try:
            return self.tok.apply_chat_template_text(
                messages, add_generation_prompt=add_generation_prompt, tools=tools,
                continue_final_message=continue_final_message, **kwargs)
        except TokenizerError as e:
            if has_interleaved_system(messages):
                e = TokenizerError(
                    f"{e.message} (a system message that is not the first: the server's "
                    "--enable-interleaved-system-coalescing merges them into one at the start)")
            raise bad_param(e, param) from e

    def check_limits(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        """The server's caps on one request (n, prompts x n, stops), before any work."""
        try:
            check_limits(req, self.limits)
        except SamplingParamsError as e:
            raise bad_param(e) from e

    def params_for(self, req: ChatCompletionRequest | CompletionRequest, prompt_len: int
                   ) -> SamplingParams:
        try:
            params = to_sampling_params(req, self.max_model_len, prompt_len)
        except SamplingParamsError as e:
            raise bad_param(e) from e
        adapter = self.adapters.get(req.model) if req.model else None
        if adapter is not None:  # the model id names a LoRA adapter: it runs the request
            params.lora = adapter[0]
        return params

    async def check_structured(self, req: ChatCompletionRequest | CompletionRequest | None,
                               params: SamplingParams, param: str | None = None) -> None:
        """Compiles the request's output constraint (or finds it in the engine's cache) before
        admission, so an invalid schema, regex or grammar is a 400 naming its field (`param`,
        else the field of `req` that gave it). On a worker thread: a first compile can take
        milliseconds, the grammar vocabulary ~0.5 s once."""
        so = params.structured_outputs
        if so is None:
            return
        if param is None:
            found = structured_outputs_of(req) if req is not None else None
            param = found[1] if found is not None else "tool_choice"
        grammars = self.engine.structured
        if grammars is None:
            raise APIError(400, "structured output needs the model's tokenizer, and this engine "
                           "has none", param=param, code="invalid_value")
        try:
            await asyncio.to_thread(grammars.compile, so, param)
        except SamplingParamsError as e:
            raise bad_param(e) from e

    async def run_choice(self, spec: ChoiceSpec, on_started: Callable[[], None],
                         group: str | None = None) -> AsyncIterator[ChoiceEvent]:
        """One engine request as events: one per step that adds text or logprobs, and a final
        one with finish_reason set. Aborts the engine request on any early exit. `group`: the
        API request's name when it has several choices (the scheduler shares slots by it)."""
        done = False
        gen = self.engine.generate(spec.request_id, spec.prompt_ids, spec.params,
                                   cache_salt=spec.cache_salt, session_id=spec.session_id,
                                   group=group)
        try:
            async for out in gen:
                on_started()
                ev = ChoiceEvent(
                    index=spec.index, text=out.text, logprobs=out.new_logprobs or [],
                    text_offsets=out.text_offsets,
                    finish_reason=(out.finish_reason or "stop") if out.finished else None,
                    stop_reason=out.stop_reason, num_prompt_tokens=out.num_prompt_tokens,
                    num_output_tokens=out.num_output_tokens,
                    num_cached_tokens=out.num_cached_tokens, token_ids=out.new_token_ids,
                    prompt_logprobs=out.prompt_logprobs)
                if ev.finished:
                    done = True
                    yield ev
                    return
                if ev.text or ev.logprobs or ev.token_ids or ev.prompt_logprobs:
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
                        render: Callable[[ChoiceEvent], str | list[str] | None], first: list[str],
                        last: Callable[[list[ChoiceEvent]], str | None], *,
                        frame: Callable[[str], str] = data_frame, done: bool = True
                        ) -> StreamingResponse:
        """`stream` as the SSE response a streaming route returns."""
        return StreamingResponse(self.stream(request, fan, render, first, last, frame=frame,
                                             done=done),
                                 media_type="text/event-stream")

    async def stream(self, request: Request, fan: Fanout,
                     render: Callable[[ChoiceEvent], str | list[str] | None], first: list[str],
                     last: Callable[[list[ChoiceEvent]], str | None], *,
                     frame: Callable[[str], str] = data_frame, done: bool = True
                     ) -> AsyncIterator[str]:
        """Streaming: SSE lines for each event that says something (`render` makes its chunk,
        or several, or None to hold the text back); `first` chunks go out before any event;
        `last` gets every choice's final event (for the usage chunk). `frame` turns a chunk into
        its SSE text (the Responses API names each event); `done`: close with `data: [DONE]`
        (the completions APIs)."""
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
                yield frame(line)
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
                    yield frame(json.dumps(api_err.body()))
                    break
                if dump is not None:
                    dump.add(item)
                # A step that added no text or logprobs and finished nothing has nothing to send;
                # nor has one whose text the route holds back (render gives None).
                if item.text or item.logprobs or item.finished or item.prompt_logprobs:
                    chunks = render(item)
                    if chunks is not None:
                        for c in [chunks] if isinstance(chunks, str) else chunks:
                            yield frame(c)
                        sent += 1
                if item.finished:
                    finals.append(item)
                    remaining -= 1
            if not remaining:
                tail = last(finals)
                if tail is not None:
                    yield frame(tail)
            if done:
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
        # The choices of one API request are one group to the scheduler: n=128 cannot take
        # every sequence slot from the requests that come after it.
        self.group = specs[0].request_id if len(specs) > 1 else None
        self.tasks = [asyncio.create_task(self._pump(serving, spec, self._started[i]))
                      for i, spec in enumerate(specs)]

    async def _pump(self, serving: Serving, spec: ChoiceSpec, started: asyncio.Future[None]
                    ) -> None:
        def on_started() -> None:
            if not started.done():
                started.set_result(None)

        try:
            async for ev in serving.run_choice(spec, on_started, self.group):
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
