"""What every generating route shares: the served names, turning a request into engine requests
(one per prompt), and carrying their outputs back, whole or as SSE.

    route --PromptSpecs--> Serving.start: one engine request per prompt (the engine fans it out
      to its n choices), all admitted (or 503) before any header is sent --> Outputs merges the
      prompts' RequestOutputs --> Serving.collect (each prompt's output whole, the engine's
      FINAL_ONLY) or Serving.stream (SSE lines from its DELTA outputs, one chunk per choice)

Text, stop strings, EOS, logprobs, the n choices and their accumulation were already decided by
the engine's output processor (kiln/engine/output.py), the same one the offline LLM and `kiln
run` read. Engine requests are aborted whenever their output is no longer wanted (client gone,
another prompt failed), so their KV blocks come back at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from kiln.engine.output import CompletionOutput, RequestOutput
from kiln.sampling_params import SamplingParams, SamplingParamsError
from kiln.server.chat_output import ChatFormat
from kiln.server.errors import APIError, ClientGone, bad_param, engine_error
from kiln.server.protocol import (
    MIN_LOGPROB,
    ChatCompletionRequest,
    CompletionRequest,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    UsageInfo,
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
class PromptSpec:
    """One engine request of an API request: a prompt and its choices (`params.n`: the engine
    fans them out), numbered in the response from `first_index` (a batch of prompts numbers
    on: OpenAI's prompt * n + choice)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str = ""  # echoed before the completion when echo=True
    first_index: int = 0
    session_id: str | None = None  # keeps this conversation's KV blocks between turns
    cache_salt: str | None = None
    group: str | None = None  # the API request's id, when it has several prompts


@dataclass
class _Failed:
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

    async def start(self, request: Request, specs: list[PromptSpec], body: Any = None
                    ) -> Outputs:
        """Submit every prompt and wait until all are admitted; 503 when the engine is full.
        `body` (the validated request) goes into the request dump, when one is written."""
        outs = Outputs(self, specs)
        if self.dumper is not None and body is not None:
            outs.dump = self.dumper.begin(request.url.path.removeprefix("/v1/"), body, specs)
        watcher = asyncio.create_task(_watch_disconnect(request, outs.disconnect))
        try:
            await outs.wait_started()
        except BaseException as e:  # overloaded, client gone, handler cancelled: stop them all
            outs.cancel()
            if outs.dump is not None:
                outs.dump.write(error=f"{type(e).__name__}: {e}")
            mapped = engine_error(e)
            if mapped is e:
                raise
            raise mapped from e
        finally:
            watcher.cancel()
        return outs

    async def collect(self, request: Request, outs: Outputs) -> list[RequestOutput]:
        """Non-streaming: each prompt's output, every choice whole (the engine's FINAL_ONLY
        output), in the order of `outs.specs`; aborts on client disconnect."""
        got: dict[int, RequestOutput] = {}
        watcher = asyncio.create_task(_watch_disconnect(request, outs.disconnect))
        try:
            while outs.remaining:
                item = await outs.next()
                if isinstance(item, _Failed):
                    if outs.dump is not None:
                        outs.dump.write(error=str(item.error))
                    err = engine_error(item.error)
                    if err is item.error:
                        raise err
                    raise err from item.error
                pos, out = item
                got[pos] = out
        finally:
            watcher.cancel()
            outs.cancel()
        if outs.dump is not None:
            outs.dump.write()
        return [got[i] for i in range(len(outs.specs))]

    def stream_response(self, request: Request, outs: Outputs, render: Render,
                        first: list[str], last: Callable[[], str | None], *,
                        frame: Callable[[str], str] = data_frame, done: bool = True
                        ) -> StreamingResponse:
        """`stream` as the SSE response a streaming route returns."""
        return StreamingResponse(self.stream(request, outs, render, first, last, frame=frame,
                                             done=done),
                                 media_type="text/event-stream")

    async def stream(self, request: Request, outs: Outputs, render: Render, first: list[str],
                     last: Callable[[], str | None], *,
                     frame: Callable[[str], str] = data_frame, done: bool = True
                     ) -> AsyncIterator[str]:
        """Streaming: SSE lines for each choice each DELTA output moved (`render(spec, out,
        choice)` makes its chunk, or several, or None when there is nothing to say or the text
        is held back); `first` chunks go out before any output; `last()` after every choice
        finished (the usage chunk: `outs.usage()` counts them all by then). `frame` turns a
        chunk into its SSE text (the Responses API names each event); `done`: close with
        `data: [DONE]` (the completions APIs)."""
        # Starlette also cancels this generator on disconnect (ASGI spec < 2.4), but not on every
        # server; our own watcher makes the abort certain either way.
        watcher = asyncio.create_task(_watch_disconnect(request, outs.disconnect))
        dump = outs.dump
        error: str | None = None
        # --diagnostic-fault drop_stream:N: this stream is cut after N chunks (a drill).
        drop_after = self.faults.take_drop_stream() if self.faults is not None else None
        sent = 0
        try:
            for line in first:
                yield frame(line)
            while outs.remaining:
                if drop_after is not None and sent >= drop_after:
                    log.warning("stream cut after %d chunks by --diagnostic-fault drop_stream",
                                sent)
                    error = f"dropped by --diagnostic-fault drop_stream:{drop_after}"
                    outs.disconnect()  # as when the client leaves: its requests are aborted
                    raise StreamDropped(error)
                try:
                    item = await outs.next()
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
                pos, out = item
                for co in out.outputs:
                    chunks = render(outs.specs[pos], out, co)
                    if chunks:  # None or []: nothing to say for this choice this step
                        for c in [chunks] if isinstance(chunks, str) else chunks:
                            yield frame(c)
                        sent += 1
            if not outs.remaining:
                tail = last()
                if tail is not None:
                    yield frame(tail)
            if done:
                yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            outs.cancel()
            if dump is not None:
                dump.write(error=error)


# A route's SSE chunk(s) for one choice of one output: (its prompt, the output, the choice)
Render = Callable[[PromptSpec, RequestOutput, CompletionOutput], "str | list[str] | None"]


class Outputs:
    """The engine outputs of one API request's prompts, merged into one queue in arrival order
    (one task per prompt; each prompt's choices come back inside its RequestOutputs). Counts
    what usage reports as they pass, and hands them to the request dump."""

    def __init__(self, serving: Serving, specs: list[PromptSpec]) -> None:
        self.specs = specs
        self.queue: asyncio.Queue[tuple[int, RequestOutput] | _Failed | _Disconnected] = (
            asyncio.Queue())
        self.disconnected = False
        self.dump: RequestDump | None = None  # --request-dump-dir
        self.remaining = len(specs)  # prompts not finished
        self._cached = [0] * len(specs)  # per prompt: its prefix-cache hit
        self._generated: dict[tuple[int, int], int] = {}  # (prompt, choice) -> its tokens
        loop = asyncio.get_running_loop()
        self._started: list[asyncio.Future[None]] = [loop.create_future() for _ in specs]
        self.tasks = [asyncio.create_task(self._pump(serving, i, spec))
                      for i, spec in enumerate(specs)]

    async def _pump(self, serving: Serving, pos: int, spec: PromptSpec) -> None:
        started = self._started[pos]
        gen = serving.engine.generate(spec.request_id, spec.prompt_ids, spec.params,
                                      cache_salt=spec.cache_salt, session_id=spec.session_id,
                                      group=spec.group)
        try:
            async for out in gen:
                if not started.done():
                    started.set_result(None)
                await self.queue.put((pos, out))
                if out.finished:
                    return
            raise RuntimeError(f"the engine stream of {spec.request_id} ended unfinished")
        except Exception as e:  # noqa: BLE001 - surfaced to the handler via the queue / future
            if not started.done():
                started.set_exception(e)
            await self.queue.put(_Failed(e))
        finally:
            if not started.done():
                started.set_result(None)
            try:  # leaving early aborts the engine request (AsyncEngine.generate)
                await gen.aclose()
            except Exception:  # closing must never mask the original outcome
                log.debug("closing engine stream %s failed", spec.request_id, exc_info=True)

    async def wait_started(self) -> None:
        """Wait until every prompt was admitted by the engine (its first output arrived) or one
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
        """Stop every prompt; their engine requests are aborted as their streams close."""
        for t in self.tasks:
            t.cancel()

    def disconnect(self) -> None:
        self.disconnected = True
        self.cancel()
        self.queue.put_nowait(_Disconnected())

    async def next(self) -> tuple[int, RequestOutput] | _Failed:
        """The next output, as (its prompt's position in `specs`, the output)."""
        item = await self.queue.get()
        if isinstance(item, _Disconnected):
            raise ClientGone()
        if isinstance(item, tuple):
            pos, out = item
            self._cached[pos] = max(self._cached[pos], out.num_cached_tokens)
            for co in out.outputs:
                self._generated[pos, co.index] = co.num_output_tokens
            if out.finished:
                self.remaining -= 1
            if self.dump is not None:
                self.dump.add(pos, out)
        return item

    def usage(self) -> UsageInfo:
        """OpenAI's usage of the outputs so far: every prompt once, every choice's tokens, the
        prefix-cache hit of each prompt (its choices share it)."""
        prompt = sum(len(s.prompt_ids) for s in self.specs)
        completion = sum(self._generated.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self._cached)))


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    # The body is already read, so the next ASGI message is the disconnect (or it never comes).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return
