"""The OpenAI-compatible HTTP app: routers over one `Serving`, errors mapped in one place.

    request JSON --protocol.py--> validated request --routes/--> engine requests (serving.py)
      --> the engine's outputs (text already cut at stops) --> SSE chunks, or one JSON response

Every error leaves as OpenAI's `{"error": {...}}` (server/errors.py), and nothing a client sends
can stop the server.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.server.errors import APIError, ClientGone, validation_error
from kiln.server.routes import admin, generation
from kiln.server.serving import Serving
from kiln.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kiln.engine.async_engine import AsyncEngine
    from kiln.obs.dump import RequestDumper
    from kiln.obs.faults import Faults

log = logging.getLogger(__name__)


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, served_model_names: list[str], *,
              api_key: str | None, max_model_len: int, version: str,
              dumper: RequestDumper | None = None, faults: Faults | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under every name in `served_model_names` (first is the
    primary; an omitted `model` means it). With `api_key`, /v1/* needs `Authorization: Bearer`.
    `dumper` writes a bundle per request (--request-dump-dir); `faults`: diagnostic faults
    (drop_stream is the server's)."""
    sv = Serving(engine, tokenizer, served_model_names, max_model_len=max_model_len,
                 version=version, dumper=dumper, faults=faults)
    app = FastAPI(title="kiln", version=version, docs_url=None, redoc_url=None)
    app.state.kiln = sv

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; never delivered

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                    api_key.encode()):
            raise APIError(401, "Missing or invalid API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
    for r in (generation.router(sv), admin.models_router(sv)):
        v1.include_router(r)
    app.include_router(v1)
    app.include_router(admin.router(sv))
    return app
