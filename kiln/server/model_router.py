"""Several models behind one endpoint (`kiln serve --models a,b`): the router's HTTP app.

    request --(its "model")--> ModelPool.acquire (loads it on first use, waits bounded)
            --> the model's own `kiln serve` on a loopback port, body and answer passed through
                byte for byte (SSE included); a client that goes away closes the upstream
                request, so the model's server frees its KV blocks as it would for a direct one

What the router answers itself: the chat page and dashboard (kiln/ui/), /health, /v1/models (every model, loaded or not, with its
state), /router/models (the pool: pids, ports, memory, for `kiln ps`), /metrics (the loaded
models' own metrics, families merged, each series labelled with its model_name as vLLM does,
plus the router's loads and unloads). Errors are OpenAI's JSON like the single-model server's.
Requests that name no model go to the first one, as a single server's primary name.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.server.errors import APIError
from kiln.server.http import HttpLimits, api_key_guard
from kiln.server.model_pool import ModelPool, ModelUnavailable
from kiln.settings.values import parse_duration

log = logging.getLogger("kiln.router")

# Routes whose JSON body names the model; each goes to that model's server unchanged.
MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
                "/v1/rerank", "/rerank", "/tokenize", "/detokenize", "/v1/audio/speech",
                "/v1/audio/transcriptions", "/v1/audio/translations")
# Hop-by-hop headers and the ones httpx sets itself are not passed through.
_DROP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
         "te", "trailer", "proxy-authorization", "proxy-authenticate"}


def build_router_app(pool: ModelPool, *, api_key: str | None, version: str,
                     max_body_bytes: int, max_header_bytes: int,
                     preload: bool = False, ui_pages: bool = True) -> FastAPI:
    http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=64))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        import asyncio

        reaper = asyncio.get_running_loop().create_task(pool.reap())
        if preload:
            await pool.preload()
        try:
            yield
        finally:
            reaper.cancel()
            await pool.close()
            await http.aclose()

    app = FastAPI(title="kiln router", version=version, docs_url=None, redoc_url=None,
                  lifespan=lifespan)
    app.state.pool = pool
    app.add_middleware(HttpLimits, limit=max_body_bytes, max_header_bytes=max_header_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    guard = [Depends(api_key_guard(api_key))]
    first = next(iter(pool.entries))

    async def forward(request: Request) -> Response:
        body = await request.body()
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            # An audio upload: the model is a form field; the body goes on as it came.
            form = await request.form()  # parses the body read above (starlette keeps it)
            payload: dict[str, Any] = {"model": form.get("model")}
        else:
            try:
                payload = json.loads(body) if body else {}
            except ValueError:
                raise APIError(400, "the request body is not valid JSON",
                               code="invalid_json") from None
        if not isinstance(payload, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_value")
        name = payload.get("model") or first
        keep_alive = None
        if "keep_alive" in payload:  # Ollama's per-request field: the router's, not the model's
            try:
                keep_alive = parse_duration(payload.pop("keep_alive"))
            except ValueError as e:
                raise APIError(400, f"keep_alive: {e}", param="keep_alive",
                               code="invalid_value") from None
            body = json.dumps(payload).encode()
        if not isinstance(name, str):
            raise APIError(400, "model must be a string", param="model", code="invalid_value")
        try:
            child = await pool.acquire(name, keep_alive)
        except ModelUnavailable as e:
            raise APIError(e.status, str(e), param="model" if e.status == 404 else None,
                           code="model_not_found" if e.status == 404 else "model_unavailable"
                           ) from None
        url = child.url + request.url.path + (f"?{request.url.query}" if request.url.query
                                              else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        try:
            upstream = await http.send(http.build_request(request.method, url, headers=headers,
                                                          content=body), stream=True)
        except httpx.HTTPError as e:
            pool.release(child)
            raise APIError(503, f"model {name!r} did not answer ({type(e).__name__}); "
                                "retry", code="model_unavailable") from None

        done = False

        async def finish() -> None:
            """Closes the upstream answer and ends the request's hold on the model, once:
            from the relay's end, or (a client gone before the answer started, whose relay
            never ran) from the response's background task."""
            nonlocal done
            if not done:
                done = True
                await upstream.aclose()
                pool.release(child)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # also when the client went away: the model's server sees it go too
                await finish()

        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP}
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=out_headers,
                                 background=BackgroundTask(finish))

    for path in MODEL_ROUTES:
        app.add_api_route(path, forward, methods=["POST"], dependencies=guard,
                          include_in_schema=False)

    v1 = APIRouter(prefix="/v1", dependencies=guard)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_card(m) for m in pool.status()]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        for m in pool.status():
            if m["id"] == model_id:
                return _card(m)
        raise APIError(404, f"The model {model_id!r} does not exist", param="model",
                       code="model_not_found")

    @v1.get("/responses/{response_id}")
    async def stored_response(response_id: str, request: Request) -> Response:
        """A stored response lives in the model's server that made it: ask the loaded ones."""
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for child in list(pool.children.values()):
            if not child.ready.is_set() or child.error:
                continue
            r = await http.get(f"{child.url}/v1/responses/{response_id}", headers=headers)
            if r.status_code != 404:
                return Response(r.content, r.status_code, media_type="application/json")
        raise APIError(404, f"no stored response {response_id!r} (its model may have been "
                            "unloaded since)", param="response_id", code="response_not_found")

    async def from_loaded(path: str, request: Request) -> list[httpx.Response]:
        """GET `path` from every loaded model's server, with the caller's key."""
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        out = []
        for child in list(pool.children.values()):
            if child.ready.is_set() and not child.error:
                try:
                    out.append(await http.get(child.url + path, headers=headers, timeout=5.0))
                except httpx.HTTPError:
                    continue
        return out

    # The dashboard (kiln/ui/) over a router: each loaded model's stats side by side (they are
    # keyed by model already), and the effective config of the model asked for (else the
    # first loaded): every model has its own.
    @v1.get("/dashboard/stats")
    async def dashboard_stats(request: Request) -> dict[str, Any]:
        models = [m for r in await from_loaded("/v1/dashboard/stats", request)
                  if r.status_code == 200 for m in r.json().get("models", [])]
        return {"time": time.time(), "version": version, "models": models}

    @v1.get("/dashboard/config")
    async def dashboard_config(request: Request, model: str | None = None) -> Response:
        for child in list(pool.children.values()):
            if child.ready.is_set() and not child.error and model in (None, child.name):
                r = await http.get(f"{child.url}/v1/dashboard/config", timeout=5.0,
                                   headers={k: v for k, v in request.headers.items()
                                            if k.lower() == "authorization"})
                return Response(r.content, r.status_code, media_type="application/json")
        raise APIError(404, "no model is loaded yet: each model's config exists once it runs",
                       code="not_found")

    app.include_router(v1)
    if ui_pages:  # the same chat page and dashboard as a single model's server
        from kiln.server.routes.ui import mount_pages

        mount_pages(app)

    @app.get("/router/models", dependencies=guard)
    async def router_models() -> dict[str, Any]:
        return {"models": pool.status(), "loads": pool.loads, "unloads": pool.unloads}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "models": {m["id"]: m["state"] for m in pool.status()}}

    @app.get("/version")
    async def version_() -> dict[str, str]:
        return {"version": version}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        texts = []
        for child in list(pool.children.values()):
            if child.ready.is_set() and not child.error:
                try:
                    texts.append((await http.get(f"{child.url}/metrics", timeout=5.0)).text)
                except httpx.HTTPError:
                    continue
        texts.append(_router_metrics(pool))
        return PlainTextResponse(merge_metrics(texts),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _card(m: dict[str, Any]) -> dict[str, Any]:
    return {"id": m["id"], "object": "model", "created": int(time.time()), "owned_by": "kiln",
            "root": m["model"], "state": m["state"], "memory_bytes": m["memory_bytes"]}


def _router_metrics(pool: ModelPool) -> str:
    loaded = sum(m["state"] == "loaded" for m in pool.status())
    return (f"# HELP kiln_router_models_loaded Models loaded now.\n"
            f"# TYPE kiln_router_models_loaded gauge\nkiln_router_models_loaded {loaded}\n"
            f"# HELP kiln_router_model_loads_total Model loads started.\n"
            f"# TYPE kiln_router_model_loads_total counter\n"
            f"kiln_router_model_loads_total {pool.loads}\n"
            f"# HELP kiln_router_model_unloads_total Models unloaded.\n"
            f"# TYPE kiln_router_model_unloads_total counter\n"
            f"kiln_router_model_unloads_total {pool.unloads}\n")


def merge_metrics(texts: list[str]) -> str:
    """Prometheus text expositions of several servers as one: a metric's HELP/TYPE once and all
    its series together (the format wants a family in one group). The series stay apart by
    their labels (kiln's carry model_name)."""
    families: dict[str, list[str]] = {}
    heads: dict[str, list[str]] = {}
    for text in texts:
        current = ""
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                current = line.split()[2]
                head = heads.setdefault(current, [])
                if len(head) < 2 and line not in head:
                    head.append(line)
                families.setdefault(current, [])
            elif line and not line.startswith("#"):
                families.setdefault(current or line.split("{")[0].split()[0], []).append(line)
    out = []
    for name, lines in families.items():
        out += heads.get(name, [])
        out += lines
    return "\n".join(out) + "\n"
