"""POST /v1/chat/completions: messages through the model's chat template, OpenAI's shapes."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kiln.engine.request import TokenLogprob
from kiln.server.errors import ClientGone, bad_param
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
    PromptTokensDetails,
    UsageInfo,
)
from kiln.server.serving import ChoiceEvent, ChoiceSpec, Serving, clamp_logprob
from kiln.tokenizer import Tokenizer, TokenizerError


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


async def create_chat_completion(sv: Serving, req: ChatCompletionRequest, request: Request
                                 ) -> Any:
    model = sv.check_model(req.model)
    kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
    try:
        prompt_ids = sv.tok.apply_chat_template(
            req.template_messages(), add_generation_prompt=req.add_generation_prompt,
            tools=req.template_tools(), continue_final_message=req.continue_final_message,
            **kwargs)
    except TokenizerError as e:
        raise bad_param(e, "messages") from e
    params = sv.params_for(req, len(prompt_ids))
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    # A conversation names its session with X-Session-Id, or else OpenAI's `user` field.
    session = request.headers.get("x-session-id") or req.user
    specs = [ChoiceSpec(f"{rid}-{i}", i, prompt_ids, params.for_choice(i),
                        session_id=session if req.n == 1 else None, cache_salt=req.cache_salt)
             for i in range(req.n)]
    created = int(time.time())
    k = params.logprobs or 0
    want_lp = params.logprobs is not None
    fan = await sv.start(request, specs)

    def usage(finals: list[ChoiceEvent]) -> UsageInfo:
        completion = sum(e.num_output_tokens for e in finals)
        cached = max((e.num_cached_tokens for e in finals), default=0)
        return UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=completion,
                         total_tokens=len(prompt_ids) + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    if not req.stream:
        events = await sv.collect(request, fan)
        choices = []
        finals = []
        for i in range(req.n):
            evs = events[i]
            finals.append(evs[-1])
            lps = [lp for e in evs for lp in e.logprobs]
            choices.append(ChatCompletionChoice(
                index=i, message=ChatResponseMessage(content="".join(e.text for e in evs)),
                logprobs=chat_logprobs(sv.tok, lps, k) if want_lp else None,
                finish_reason=evs[-1].finish_reason, stop_reason=evs[-1].stop_reason))
        resp = ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                      usage=usage(finals))
        return JSONResponse(resp.model_dump(mode="json"))

    def chunk(choices: list[ChatCompletionStreamChoice], u: UsageInfo | None = None) -> str:
        return ChatCompletionChunk(id=rid, created=created, model=model, choices=choices,
                                   usage=u).model_dump_json()

    def render(ev: ChoiceEvent) -> str | None:
        if not ev.text and not ev.logprobs and not ev.finished:
            return None
        return chunk([ChatCompletionStreamChoice(
            index=ev.index, delta=DeltaMessage(content=ev.text) if ev.text else DeltaMessage(),
            logprobs=chat_logprobs(sv.tok, ev.logprobs, k) if want_lp and ev.logprobs else None,
            finish_reason=ev.finish_reason, stop_reason=ev.stop_reason)])

    first = [chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                           content=""))])
             for i in range(req.n)]

    def last(finals: list[ChoiceEvent]) -> str | None:
        return chunk([], usage(finals)) if req.include_usage else None

    return StreamingResponse(sv.stream(request, fan, render, first, last),
                             media_type="text/event-stream")


def router(sv: Serving) -> APIRouter:
    r = APIRouter()

    @r.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        try:
            return await create_chat_completion(sv, req, request)
        except ClientGone:
            return Response(status_code=499)  # nginx's "client closed request"; never delivered

    return r
