"""POST /tokenize and /detokenize in vLLM's shapes: a prompt, or messages through the chat
template exactly as /v1/chat/completions renders them, to token ids; token ids back to text."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from kiln.server.errors import APIError
from kiln.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    template_tools,
)
from kiln.server.serving import Serving


def router(sv: Serving) -> APIRouter:
    """At the root, as vLLM serves them (behind the API key when one is set)."""
    r = APIRouter()

    @r.post("/tokenize")
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest) -> Any:
        sv.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            ids = sv.chat_prompt([m.to_template_dict() for m in req.messages],
                                 tools=template_tools(req.tools),
                                 add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message,
                                 template_kwargs=req.chat_template_kwargs)
        else:
            ids = sv.tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        strs = [sv.tok.token_str(t) for t in ids] if req.return_token_strs else None
        body = TokenizeResponse(count=len(ids), max_model_len=sv.max_model_len, tokens=ids,
                                token_strs=strs)
        return JSONResponse(body.model_dump(mode="json", exclude_none=True))

    @r.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Any:
        sv.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < sv.tok.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {sv.tok.vocab_size}), got {bad[:5]}",
                           param="tokens", code="invalid_value")
        return JSONResponse(DetokenizeResponse(prompt=sv.tok.decode(req.tokens)).model_dump())

    return r
