"""POST /v1/chat/completions: messages through the model's chat template, OpenAI's shapes."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from kiln.engine.request import TokenLogprob
from kiln.server.errors import bad_param
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
    await sv.check_structured(req, params)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    # A conversation names its session with X-Session-Id, or else OpenAI's `user` field.
    session = request.headers.get("x-session-id") or req.user
    specs = [ChoiceSpec(f"{rid}-{i}", i, prompt_ids, params.for_choice(i),
                        session_id=session if req.n == 1 else None, cache_salt=req.cache_salt)
             for i in range(req.n)]
    # Every response and chunk of this request carries the same id, time and model.
    head: dict[str, Any] = {"id": rid, "created": int(time.time()), "model": model}
    k = params.logprobs or 0
    want_lp = params.logprobs is not None
    fan = await sv.start(request, specs, body=req)

    def usage(finals: list[ChoiceEvent]) -> UsageInfo:
        completion = sum(e.num_output_tokens for e in finals)
        cached = max((e.num_cached_tokens for e in finals), default=0)
        return UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=completion,
                         total_tokens=len(prompt_ids) + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    if not req.stream:
        outs = await sv.collect(request, fan)
        choices = [ChatCompletionChoice(
            index=i, message=ChatResponseMessage(content=out.text),
            logprobs=chat_logprobs(sv.tok, out.logprobs, k) if want_lp else None,
            finish_reason=out.finish_reason, stop_reason=out.stop_reason)
            for i, out in outs.items()]
        resp = ChatCompletionResponse(**head, choices=choices, usage=usage(list(outs.values())))
        return JSONResponse(resp.model_dump(mode="json"))

    def chunk(choices: list[ChatCompletionStreamChoice], u: UsageInfo | None = None) -> str:
        return ChatCompletionChunk(**head, choices=choices, usage=u).model_dump_json()

    def render(ev: ChoiceEvent) -> str:
        return chunk([ChatCompletionStreamChoice(
            index=ev.index, delta=DeltaMessage(content=ev.text) if ev.text else DeltaMessage(),
            logprobs=chat_logprobs(sv.tok, ev.logprobs, k) if want_lp and ev.logprobs else None,
            finish_reason=ev.finish_reason, stop_reason=ev.stop_reason)])

    first = [chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                           content=""))])
             for i in range(req.n)]

    return sv.stream_response(request, fan, render, first,
                              lambda fin: chunk([], usage(fin)) if req.include_usage else None)
