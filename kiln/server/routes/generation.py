"""The generating endpoints, POST /chat/completions and /completions, on one router over the
shared `Serving` (what each does is in chat.py and completions.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from kiln.server.protocol import ChatCompletionRequest, CompletionRequest
from kiln.server.routes.chat import create_chat_completion
from kiln.server.routes.completions import create_completion
from kiln.server.serving import Serving


def router(sv: Serving) -> APIRouter:
    """Under /v1, behind the API key. A client gone before its answer is app.py's 499."""
    r = APIRouter()

    @r.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        return await create_chat_completion(sv, req, request)

    @r.post("/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await create_completion(sv, req, request)

    return r
