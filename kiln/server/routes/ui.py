"""The browser pages and what they read.

  GET /            the chat page (kiln/ui/chat.html)        } off with --no-ui; no key needed:
  GET /dashboard   the dashboard (kiln/ui/dashboard.html)   } the pages hold no data, their
  GET /ui/*        their scripts and styles                 } requests carry the key
  GET /v1/dashboard/stats   the metrics registry by model (server/dashboard_stats.py)
  GET /v1/dashboard/config  the effective config: every setting with its source and reason

The pages are plain files, no build step: each fills the blocks of one frame (ui/page.html: the
head, the stylesheet, api.js), rendered by Jinja once when the routes are mounted. A
Content-Security-Policy lets them load and call nothing but this server, so a page can never
reach another origin (and no inline script runs).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from kiln.server import dashboard_stats
from kiln.server.errors import APIError
from kiln.server.metrics import ServerMetrics
from kiln.server.serving import Serving

# Found from this file, not the working directory: an installed kiln and a source tree alike.
UI_DIR = Path(__file__).resolve().parents[2] / "ui"
CSP = ("default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
       "form-action 'none'; frame-ancestors 'none'")
PAGES = {"/": "chat.html", "/dashboard": "dashboard.html"}


def render_pages() -> dict[str, str]:
    """{route: the page's HTML}. Autoescaped, and an unknown name fails the render rather than
    printing empty, though the pages take no values: they are the same for every server."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(UI_DIR), autoescape=True,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True)
    return {path: env.get_template(name).render() for path, name in PAGES.items()}


def mount_pages(app: FastAPI) -> None:
    """/ and /dashboard, and their files under /ui (kept out of the OpenAPI schema: not API)."""

    def page(html: str) -> Callable[[], Any]:
        async def serve() -> Any:
            return HTMLResponse(html, headers={"Content-Security-Policy": CSP,
                                               "Cache-Control": "no-cache"})
        return serve

    for path, html in render_pages().items():
        app.add_api_route(path, page(html), methods=["GET"], include_in_schema=False)
    app.mount("/ui", StaticFiles(directory=UI_DIR), name="ui")


def dashboard_router(sv: Serving, metrics: ServerMetrics,
                     effective_config: Callable[[], dict[str, Any]] | None) -> APIRouter:
    """Under /v1, behind the API key (the config names files and hosts)."""
    r = APIRouter()

    @r.get("/dashboard/stats")
    async def stats() -> Any:
        return JSONResponse(dashboard_stats.snapshot(metrics.registry, sv.names,
                                                     max_model_len=sv.max_model_len,
                                                     version=sv.version))

    @r.get("/dashboard/config")
    async def config() -> Any:
        if effective_config is None:
            raise APIError(404, "this server was started without an effective config",
                           code="not_found")
        # default=str: paths and enums as text, as --effective-config-json writes them
        return Response(json.dumps(effective_config(), default=str),
                        media_type="application/json")

    return r
