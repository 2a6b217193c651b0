"""POST /v1/completions: prompts as text or token ids, `echo`, legacy logprobs."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from kiln.engine.request import TokenLogprob
from kiln.server.errors import APIError
from kiln.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
)
from kiln.server.serving import (
    ChoiceEvent,
    ChoiceSpec,
    Serving,
    clamp_logprob,
    prompt_logprobs_json,
)
from kiln.tokenizer import Tokenizer


def completion_logprobs(tok: Tokenizer, lps: list[TokenLogprob], offsets: list[int], k: int,
                        base_offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for lp, off in zip(lps, offsets, strict=True):
        out.tokens.append(tok.token_str(lp.token_id))
        out.token_logprobs.append(clamp_logprob(lp.logprob))
        out.top_logprobs.append({tok.token_str(t): clamp_logprob(v) for t, v in lp.top[:k]})
        out.text_offset.append(base_offset + off)
    return out


def completion_prompts(tok: Tokenizer, req: CompletionRequest) -> list[tuple[list[int], str]]:
    out: list[tuple[list[int], str]] = []
    for p in req.prompts():
        if isinstance(p, str):
            ids = tok.encode(p, add_special_tokens=True)
            text = p
        else:
            bad = [t for t in p if not 0 <= t < tok.vocab_size]
            if bad:
                raise APIError(400, f"prompt token ids must be in [0, {tok.vocab_size}), got "
                               f"{bad[:5]}", param="prompt", code="invalid_value")
            ids = list(p)
            text = tok.decode(ids) if req.echo else ""
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        out.append((ids, text))
    return out


async def create_completion(sv: Serving, req: CompletionRequest, request: Request) -> Any:
    model = sv.check_model(req.model)
    sv.check_limits(req)  # before tokenizing what may be thousands of prompts
    prompts = completion_prompts(sv.tok, req)
    rid = f"cmpl-{uuid.uuid4().hex}"
    specs: list[ChoiceSpec] = []
    for pi, (ids, text) in enumerate(prompts):
        params = sv.params_for(req, len(ids))
        for i in range(req.n):
            idx = pi * req.n + i  # OpenAI's numbering for a batch of prompts
            specs.append(ChoiceSpec(f"{rid}-{idx}", idx, ids, params.for_choice(i), text,
                                    cache_salt=req.cache_salt))
    await sv.check_structured(req, specs[0].params)  # one constraint for every prompt
    want_lp = req.logprobs is not None
    k = req.logprobs or 0
    # Every response and chunk of this request carries the same id, time and model.
    head: dict[str, Any] = {"id": rid, "created": int(time.time()), "model": model}
    fan = await sv.start(request, specs, body=req)

    def usage(finals: list[ChoiceEvent]) -> UsageInfo:
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        completion = sum(e.num_output_tokens for e in finals)
        cached_by_prompt: dict[int, int] = {}
        for e in finals:
            pi = e.index // req.n
            cached_by_prompt[pi] = max(cached_by_prompt.get(pi, 0), e.num_cached_tokens)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                         total_tokens=prompt_tokens + completion,
                         prompt_tokens_details=PromptTokensDetails(
                             cached_tokens=sum(cached_by_prompt.values())))

    echo_len = {s.index: len(s.prompt_text) if req.echo else 0 for s in specs}

    if not req.stream:
        outs = await sv.collect(request, fan)
        choices = []
        for s in specs:
            out = outs[s.index]
            lps = (completion_logprobs(sv.tok, out.logprobs, out.text_offsets, k,
                                       echo_len[s.index]) if want_lp else None)
            choices.append(CompletionChoice(
                index=s.index, text=(s.prompt_text if req.echo else "") + out.text, logprobs=lps,
                finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                prompt_logprobs=prompt_logprobs_json(sv.tok, out.prompt_logprobs)))
        resp = CompletionResponse(**head, choices=choices, usage=usage(list(outs.values())))
        return JSONResponse(resp.model_dump(mode="json"))

    def chunk(choices: list[CompletionChoice], u: UsageInfo | None = None) -> str:
        return CompletionChunk(**head, choices=choices, usage=u).model_dump_json()

    def render(ev: ChoiceEvent) -> str:
        lp = (completion_logprobs(sv.tok, ev.logprobs, ev.text_offsets, k, echo_len[ev.index])
              if want_lp and ev.logprobs else None)
        return chunk([CompletionChoice(index=ev.index, text=ev.text, logprobs=lp,
                                       finish_reason=ev.finish_reason,
                                       stop_reason=ev.stop_reason,
                                       prompt_logprobs=prompt_logprobs_json(
                                           sv.tok, ev.prompt_logprobs))])

    first = ([chunk([CompletionChoice(index=s.index, text=s.prompt_text)])
              for s in specs if s.prompt_text] if req.echo else [])

    return sv.stream_response(request, fan, render, first,
                              lambda fin: chunk([], usage(fin)) if req.include_usage else None)
