"""POST /v1/completions: prompts as text or token ids, `echo`, legacy logprobs."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from kiln.engine.output import CompletionOutput, RequestOutput
from kiln.engine.request import TokenLogprob
from kiln.server.errors import APIError
from kiln.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from kiln.server.serving import (
    PromptSpec,
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
    # One engine request per prompt (the engine runs its n choices, kiln/engine/output.py),
    # one scheduler group for them all.
    batch = len(prompts) > 1
    specs = [PromptSpec(f"{rid}-{pi}" if batch else rid, ids, sv.params_for(req, len(ids)), text,
                        first_index=pi * req.n, cache_salt=req.cache_salt,
                        group=rid if batch else None)
             for pi, (ids, text) in enumerate(prompts)]
    await sv.check_structured(req, specs[0].params)  # one constraint for every prompt
    want_lp = req.logprobs is not None
    k = req.logprobs or 0
    # Every response and chunk of this request carries the same id, time and model.
    head: dict[str, Any] = {"id": rid, "created": int(time.time()), "model": model}
    outs = await sv.start(request, specs, body=req)

    def echo_len(s: PromptSpec) -> int:
        return len(s.prompt_text) if req.echo else 0

    if not req.stream:
        choices = []
        for s, out in zip(specs, await sv.collect(request, outs), strict=True):
            for co in out.outputs:
                lps = (completion_logprobs(sv.tok, co.logprobs or [], co.text_offsets, k,
                                           echo_len(s)) if want_lp else None)
                choices.append(CompletionChoice(
                    index=s.first_index + co.index,
                    text=(s.prompt_text if req.echo else "") + co.text, logprobs=lps,
                    finish_reason=co.finish_reason, stop_reason=co.stop_reason,
                    prompt_logprobs=prompt_logprobs_json(sv.tok, out.prompt_logprobs)))
        resp = CompletionResponse(**head, choices=choices, usage=outs.usage())
        return JSONResponse(resp.model_dump(mode="json"))

    def chunk(choices: list[CompletionChoice], u: UsageInfo | None = None) -> str:
        return CompletionChunk(**head, choices=choices, usage=u).model_dump_json()

    # Each choice's first chunk carries its prompt's logprobs (the engine gives them once per
    # prompt, on its first output).
    prompt_lps: dict[str, Any] = {}
    lps_sent: set[int] = set()

    def render(s: PromptSpec, out: RequestOutput, co: CompletionOutput) -> str | None:
        index = s.first_index + co.index
        if out.prompt_logprobs is not None:
            prompt_lps[s.request_id] = prompt_logprobs_json(sv.tok, out.prompt_logprobs)
        plp = prompt_lps.get(s.request_id) if index not in lps_sent else None
        lp = (completion_logprobs(sv.tok, co.logprobs, co.text_offsets, k, echo_len(s))
              if want_lp and co.logprobs else None)
        if not (co.text or lp or co.finished or plp):
            return None  # a step that added no text (held back) and finished nothing
        if plp is not None:
            lps_sent.add(index)
        return chunk([CompletionChoice(index=index, text=co.text, logprobs=lp,
                                       finish_reason=co.finish_reason,
                                       stop_reason=co.stop_reason, prompt_logprobs=plp)])

    first = ([chunk([CompletionChoice(index=s.first_index + i, text=s.prompt_text)])
              for s in specs if s.prompt_text for i in range(req.n)] if req.echo else [])

    return sv.stream_response(request, outs, render, first,
                              lambda: chunk([], outs.usage()) if req.include_usage else None)
