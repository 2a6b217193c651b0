"""The OpenAI-compatible HTTP app: routers over one `Serving`, errors mapped in one place.

    request JSON --protocol.py--> validated request --routes/--> engine requests (serving.py)
      --> the engine's outputs (text already cut at stops) --> SSE chunks, or one JSON response

Every error leaves as OpenAI's `{"error": {...}}` (server/errors.py), and nothing a client sends
can stop the server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.server.audio_protocol import (
    SpeechAudioDelta,
    SpeechAudioDone,
    Transcription,
    TranscriptTextDelta,
    TranscriptTextDone,
)
from kiln.server.chat_output import ChatFormat
from kiln.server.embeddings_protocol import EmbeddingResponse, RerankResponse
from kiln.server.errors import APIError, ClientGone, validation_error
from kiln.server.http import BodyTooLarge, Cors, HttpLimits, api_key_guard
from kiln.server.metrics import ServerMetrics
from kiln.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from kiln.server.request_params import RequestLimits
from kiln.server.responses_protocol import ResponseObject, ResponseStreamEvent
from kiln.server.routes import admin, audio, embeddings, generation, responses, tokenize, ui
from kiln.server.routes import lora as lora_routes
from kiln.server.routes.lora import LoRAOptions
from kiln.server.serving import Serving
from kiln.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kiln.engine.async_engine import AsyncEngine
    from kiln.kinds.embedding import EmbeddingEngine
    from kiln.obs.dump import RequestDumper
    from kiln.obs.faults import Faults

log = logging.getLogger(__name__)


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, served_model_names: list[str], *,
              api_key: str | None, max_model_len: int, version: str,
              limits: RequestLimits | None = None, dumper: RequestDumper | None = None,
              faults: Faults | None = None, kind: str = "generate",
              embedder: EmbeddingEngine | None = None, responses_store_size: int = 1024,
              coalesce_system: bool = False, chat: ChatFormat | None = None,
              cors: Cors | None = None, ui_pages: bool = True,
              effective_config: Callable[[], dict[str, Any]] | None = None,
              lora: LoRAOptions | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under every name in `served_model_names` (first is the
    primary; an omitted `model` means it). With `api_key`, /v1/* needs `Authorization: Bearer`.
    `limits`: caps on one request (defaults: the settings table's); `dumper` writes a bundle per
    request (--request-dump-dir); `faults`: diagnostic faults (drop_stream is the server's).
    `kind` (kiln/kinds/): what the model serves; with "embed", `embedder` runs /v1/embeddings
    and /v1/rerank (`engine` is then the embedder too) and the generating routes refuse; with
    "transcribe" / "speech", `engine` is the audio model's thread (kiln/kinds/worker.py).
    `responses_store_size`: /v1/responses kept for previous_response_id (--responses-store-size);
    `coalesce_system`: --enable-interleaved-system-coalescing; `chat`: tool-call and reasoning
    parsers, enable_thinking (default: none of them); `cors`: the origins browsers may call from
    (None: CORS off); `ui_pages`: the chat page at / and the dashboard (--no-ui: off);
    `effective_config`: what /v1/dashboard/config shows (startup_report.effective_config); `lora`: the
    LoRA adapters' model ids and runtime updates (None: the LoRA routes answer that runtime
    updates are off)."""
    sv = Serving(engine, tokenizer, served_model_names, max_model_len=max_model_len,
                 version=version, limits=limits, dumper=dumper, faults=faults, kind=kind,
                 embedder=embedder, coalesce_system=coalesce_system, chat=chat)
    app = FastAPI(title="kiln", version=version, docs_url=None, redoc_url=None)
    app.state.kiln = sv
    lora = lora or LoRAOptions()
    sv.lora_template = lora.template
    for name, path in lora.adapters.items():
        sv.add_adapter(name, path)

    app.add_middleware(HttpLimits, limit=sv.limits.max_body_bytes,
                       max_header_bytes=sv.limits.max_header_bytes)
    if cors is not None:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=cors.origins,
                           allow_methods=cors.methods, allow_headers=cors.headers,
                           allow_credentials=cors.credentials)

    @app.exception_handler(BodyTooLarge)
    async def _body_too_large(_: Request, exc: BodyTooLarge) -> JSONResponse:
        return exc.error.response()

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

    check_api_key = api_key_guard(api_key)

    # One registry per app: several apps (tests) in one process keep their own series.
    metrics = ServerMetrics(engine.stats, engine.routing_stats, served_model_names[0],
                            max_model_len)
    engine.finished_listeners.append(metrics.observe)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
    store = responses.ResponseStore(responses_store_size)
    for r in (generation.router(sv), responses.router(sv, store), admin.models_router(sv),
              embeddings.router(sv), audio.router(sv),
              ui.dashboard_router(sv, metrics, effective_config), lora_routes.router(sv, lora)):
        v1.include_router(r)
    app.include_router(v1)
    # Rerank at the root too, as vLLM and llama-server serve it (behind the key all the same).
    app.add_api_route("/rerank", embeddings.rerank_endpoint(sv), methods=["POST"],
                      dependencies=[Depends(check_api_key)])
    # vLLM serves these at the root; they render prompts, so the key guards them too.
    app.include_router(tokenize.router(sv), dependencies=[Depends(check_api_key)])
    app.include_router(admin.debug_router(sv), dependencies=[Depends(check_api_key)])
    app.include_router(admin.router(sv, metrics))
    if ui_pages:
        ui.mount_pages(app)
    _document_responses(app, api_key is not None)
    return app


# What each path answers with 200 (the routes return JSONResponse / SSE themselves, so FastAPI
# cannot infer it): model, and the media types besides JSON.
def _sse(chunk: type | tuple[type, ...], what: str, done: bool = True) -> dict[str, Any]:
    """stream=true: each event's data is a chunk (of one of the types), an error object (a
    failure mid-stream), or the closing `[DONE]` (not in the Responses API, whose events are
    named by their type)."""
    chunks = chunk if isinstance(chunk, tuple) else (chunk,)
    # An SSE event is an object of fields; `data` holds the JSON text (contentSchema says of what).
    end = ", then [DONE]" if done else ""
    return {"text/event-stream": {"schema": {
        "description": f"SSE: {what} events{end} (stream=true)",
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string", "contentMediaType": "application/json",
                                "contentSchema": {"anyOf": [
                                    *({"$ref": f"#/components/schemas/{c.__name__}"}
                                      for c in chunks),
                                    {"$ref": "#/components/schemas/ErrorResponse"}]},
                                "description": f"a {what} JSON object, an error object"
                                               + (", or [DONE]" if done else "")},
                       **({} if done else {"event": {"type": "string"}})}}}}


_AUDIO_TEXT = {**{t: {"schema": {"type": "string"}} for t in ("text/plain", "text/vtt")},
               **_sse((TranscriptTextDelta, TranscriptTextDone), "transcript", done=False)}
_AUDIO_BYTES = {**{t: {"schema": {"type": "string", "format": "binary"}}
                   for t in ("audio/mpeg", "audio/ogg", "audio/aac", "audio/flac", "audio/wav",
                             "audio/pcm")},
                **_sse((SpeechAudioDelta, SpeechAudioDone), "speech audio", done=False)}
_OK: dict[str, tuple[type | None, dict[str, Any]]] = {
    "/v1/chat/completions": (ChatCompletionResponse,
                             _sse(ChatCompletionChunk, "chat.completion.chunk")),
    "/v1/completions": (CompletionResponse, _sse(CompletionChunk, "text_completion")),
    "/v1/responses": (ResponseObject, _sse(ResponseStreamEvent, "response event", done=False)),
    "/v1/responses/{response_id}": (ResponseObject, {}),
    "/v1/models": (ModelList, {}),
    "/v1/embeddings": (EmbeddingResponse, {}),
    "/v1/rerank": (RerankResponse, {}),
    "/rerank": (RerankResponse, {}),
    "/v1/models/{model_id}": (ModelCard, {}),
    # response_format json (verbose_json adds fields), text / srt / vtt as text, or SSE events.
    "/v1/audio/transcriptions": (Transcription, _AUDIO_TEXT),
    "/v1/audio/translations": (Transcription, _AUDIO_TEXT),
    "/v1/audio/speech": (None, _AUDIO_BYTES),
    "/tokenize": (TokenizeResponse, {}),
    "/detokenize": (DetokenizeResponse, {}),
    "/health": (None, {}),
    "/version": (None, {}),
    "/metrics": (None, {"text/plain": {"schema": {"type": "string"}}}),
    "/debug/kv": (None, {}),
    "/v1/dashboard/stats": (None, {}),
    "/v1/dashboard/config": (None, {}),
}


def _document_responses(app: FastAPI, auth: bool) -> None:
    """The OpenAPI schema says what the server really answers: its 200 bodies, and the
    OpenAI-shaped errors (400 for any invalid request, where FastAPI documents its own 422,
    which kiln never sends; 401, 404, 503 where they can happen; 500)."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (ErrorResponse, ChatCompletionResponse, CompletionResponse, ModelList,
                      ChatCompletionChunk, CompletionChunk, EmbeddingResponse, RerankResponse,
                      ResponseObject, ResponseStreamEvent, ModelCard, TokenizeResponse,
                      DetokenizeResponse, Transcription, TranscriptTextDelta,
                      TranscriptTextDone, SpeechAudioDelta, SpeechAudioDone):
            defs = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(defs.pop("$defs", {}))
            components[model.__name__] = defs
        error = {"description": "OpenAI-style error", "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for path, ops in schema["paths"].items():
            model, extra = _OK.get(path, (None, {}))
            for op in ops.values():
                ok = op["responses"].setdefault("200", {"description": "OK"})
                json_schema = ({"$ref": f"#/components/schemas/{model.__name__}"} if model
                               else {"type": "object"})
                ok["content"] = {"application/json": {"schema": json_schema}, **extra}
                if path in ("/metrics", "/v1/audio/speech"):  # never JSON
                    ok["content"] = extra
                op["responses"].pop("422", None)
                codes = ["500"]
                if "requestBody" in op:
                    codes += ["400", "404", "503"]
                elif "{" in path or path == "/v1/dashboard/config":  # an unknown id; no config
                    codes.append("404")
                guarded = (path.startswith(("/v1/", "/debug/"))
                           or path in ("/rerank", "/tokenize", "/detokenize"))
                if guarded and auth:
                    codes.append("401")
                for code in codes:
                    op["responses"][code] = error
                if path in ("/health", "/debug/kv"):  # dead engine: {"status": "error", ...}
                    op["responses"]["503"] = {"description": "engine down", "content": {
                        "application/json": {"schema": {"type": "object"}}}}
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
