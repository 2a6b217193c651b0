"""GET /v1/models, /v1/models/{id}, /health, /version, /metrics: what is served and how the
engine is doing; GET /debug/kv: the KV cache's blocks and integrity check (behind the API key)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from kiln.server.metrics import CONTENT_TYPE, ServerMetrics
from kiln.server.protocol import ModelCard, ModelList
from kiln.server.serving import Serving


def models_router(sv: Serving) -> APIRouter:
    """Under /v1, behind the API key."""
    r = APIRouter()

    def card(name: str) -> ModelCard:
        adapter = sv.adapters.get(name)
        if adapter is not None:  # as vLLM: root is the adapter's path, parent the base model
            return ModelCard(id=name, created=sv.created, root=adapter[1], parent=sv.names[0],
                             max_model_len=sv.max_model_len)
        return ModelCard(id=name, created=sv.created, root=sv.names[0],
                         max_model_len=sv.max_model_len)

    @r.get("/models")
    async def models() -> Any:
        return JSONResponse(ModelList(data=[card(n) for n in [*sv.names, *sv.adapters]]
                                      ).model_dump(mode="json"))

    # `:path`: a served name may hold slashes (owner/repo), as in OpenAI's ids.
    @r.get("/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        return JSONResponse(card(sv.check_model(model_id)).model_dump(mode="json"))

    return r


def debug_router(sv: Serving) -> APIRouter:
    """Behind the API key: what the soak benchmark and drills check between phases."""
    r = APIRouter()

    @r.get("/debug/kv")
    async def kv() -> Any:
        """Blocks total / free / used / pinned / cached, running and waiting requests, the KV
        manager's integrity check ("ok" or what broke), and when idle the leaked blocks (0)."""
        try:
            report = await sv.engine.kv_report()
        except Exception as e:  # noqa: BLE001 - a dead engine
            return JSONResponse({"status": "error", "error": str(e)}, status_code=503)
        return JSONResponse(report)

    return r


def router(sv: Serving, server_metrics: ServerMetrics) -> APIRouter:
    """Unauthenticated operational endpoints (probes and scrapers carry no key)."""
    r = APIRouter()

    @r.get("/health")
    async def health() -> Any:
        try:
            stats = dict(sv.engine.stats())
        except Exception as e:  # noqa: BLE001 - a dead engine thread shows here
            return JSONResponse({"status": "error", "error": str(e)}, status_code=503)
        return JSONResponse({"status": "ok", **stats})

    @r.get("/version")
    async def get_version() -> Any:
        return JSONResponse({"version": sv.version})

    @r.get("/metrics")
    async def metrics() -> Any:
        return Response(server_metrics.render(), media_type=CONTENT_TYPE)

    return r
