"""POST /v1/chat/completions: messages through the model's chat template, OpenAI's shapes."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from kiln.engine.output import CompletionOutput, RequestOutput
from kiln.engine.request import TokenLogprob
from kiln.sampling_params import SamplingParams
from kiln.server.chat_output import (
    ChatFormat,
    ChoiceParser,
    ToolPlan,
    plan_tools,
    reasoning_parser,
)
from kiln.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobToken,
    ChatLogprobTop,
    ChatResponseMessage,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
    UsageInfo,
)
from kiln.server.serving import (
    PromptSpec,
    Serving,
    clamp_logprob,
    prompt_logprobs_json,
)
from kiln.server.tool_call_stream import ToolCallStream
from kiln.tokenizer import Tokenizer


def chat_logprobs(tok: Tokenizer, lps: list[TokenLogprob], k: int) -> ChatChoiceLogprobs:
    content: list[ChatLogprobToken] = []
    for lp in lps:
        top = [ChatLogprobTop(token=tok.token_str(t), logprob=clamp_logprob(v),
                              bytes=list(tok.token_bytes(t))) for t, v in lp.top[:k]]
        content.append(ChatLogprobToken(token=tok.token_str(lp.token_id),
                                        logprob=clamp_logprob(lp.logprob),
                                        bytes=list(tok.token_bytes(lp.token_id)),
                                        top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


@dataclass
class ChatRun:
    """A chat request made ready for the engine: its prompt, sampling parameters and tool plan.
    /v1/chat/completions and /v1/responses (which converts its request to a chat request) both
    run what `prepare_chat` makes, so one request renders the same prompt, with the same
    special-token handling and tool constraint, through either endpoint."""

    prompt_text: str
    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolPlan
    fmt: ChatFormat

    def choice_parser(self) -> ChoiceParser:
        stream = ToolCallStream(self.tools.parser, self.tools.max_calls) \
            if self.tools.parser else None
        # Whether the template opened (or closed) the reasoning is at the prompt's end.
        return ChoiceParser(reasoning_parser(self.fmt, self.prompt_text[-64:]), stream)


async def prepare_chat(sv: Serving, req: ChatCompletionRequest) -> ChatRun:
    """Limits, the chat template, SamplingParams and the tools' plan (a constraint for
    tool_choice required / a named function, compiled here so a bad schema is a 400)."""
    sv.check_limits(req)
    prompt_text = sv.chat_prompt_text(
        req.template_messages(), add_generation_prompt=req.add_generation_prompt,
        tools=req.template_tools(), continue_final_message=req.continue_final_message,
        template_kwargs=req.chat_template_kwargs)
    # The template already writes BOS/role tokens; adding special tokens again would double BOS.
    prompt_ids = sv.tok.encode(prompt_text, add_special_tokens=False)
    params = sv.params_for(req, len(prompt_ids))
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, sv.chat,
                       sv.special_token_id)
    if tools.structured is not None:  # required / a named function: the grammar engine enforces
        params.structured_outputs = tools.structured
    if tools.parser is not None and tools.parser.keep_special_tokens:
        params.skip_special_tokens = False
    await sv.check_structured(req, params, "tool_choice" if tools.structured else None)
    return ChatRun(prompt_text, prompt_ids, params, tools, sv.chat)


async def create_chat_completion(sv: Serving, req: ChatCompletionRequest, request: Request
                                 ) -> Any:
    model = sv.check_model(req.model)
    run = await prepare_chat(sv, req)
    prompt_ids, params, choice_parser = run.prompt_ids, run.params, run.choice_parser

    rid = f"chatcmpl-{uuid.uuid4().hex}"
    # A conversation names its session with X-Session-Id, or else OpenAI's `user` field.
    session = request.headers.get("x-session-id") or req.user
    # One engine request: the engine runs its n choices (kiln/engine/output.py).
    spec = PromptSpec(rid, prompt_ids, params, session_id=session if req.n == 1 else None,
                      cache_salt=req.cache_salt)
    # Every response and chunk of this request carries the same id, time and model.
    head: dict[str, Any] = {"id": rid, "created": int(time.time()), "model": model}
    k = params.logprobs or 0
    want_lp = params.logprobs is not None
    outs = await sv.start(request, [spec], body=req)

    def finish(reason: str | None, p: ChoiceParser) -> str | None:
        # OpenAI: a message that ends in tool calls finishes with "tool_calls"; one cut by
        # max_tokens keeps "length".
        return "tool_calls" if reason == "stop" and p.called else reason

    if not req.stream:
        (out,) = await sv.collect(request, outs)
        choices = []
        for co in out.outputs:
            p = choice_parser()
            p.feed(co.text, final=True)
            r = p.result
            calls = [ToolCall.model_validate(c) for c in r.tool_calls]
            message = ChatResponseMessage(content=None if calls and not r.content else r.content,
                                          reasoning_content=r.reasoning or None,
                                          tool_calls=calls or None)
            choices.append(ChatCompletionChoice(
                index=co.index, message=message,
                logprobs=chat_logprobs(sv.tok, co.logprobs or [], k) if want_lp else None,
                finish_reason=finish(co.finish_reason, p), stop_reason=co.stop_reason))
        # vLLM reports them once, for the (shared) prompt
        resp = ChatCompletionResponse(**head, choices=choices, usage=outs.usage(),
                                      prompt_logprobs=prompt_logprobs_json(
                                          sv.tok, out.prompt_logprobs))
        return JSONResponse(resp.model_dump(mode="json"))

    def chunk(choices: list[ChatCompletionStreamChoice], u: UsageInfo | None = None) -> str:
        return ChatCompletionChunk(**head, choices=choices, usage=u).model_dump_json()

    parsers = {i: choice_parser() for i in range(req.n)}

    def render(_: PromptSpec, out: RequestOutput, co: CompletionOutput) -> str | None:
        p = parsers[co.index]
        d = p.feed(co.text, final=co.finished)
        delta = DeltaMessage(content=d.content or None, reasoning_content=d.reasoning or None,
                             tool_calls=[DeltaToolCall.model_validate(c) for c in d.tool_calls]
                             or None)
        lps = chat_logprobs(sv.tok, co.logprobs, k) if want_lp and co.logprobs else None
        if not (d.content or d.reasoning or d.tool_calls or lps or co.finished):
            return None  # held back (a tag or call not decided yet): nothing to say
        return chunk([ChatCompletionStreamChoice(
            index=co.index, delta=delta, logprobs=lps,
            finish_reason=finish(co.finish_reason, p), stop_reason=co.stop_reason)])

    first = [chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                           content=""))])
             for i in range(req.n)]

    return sv.stream_response(request, outs, render, first,
                              lambda: chunk([], outs.usage()) if req.include_usage else None)
