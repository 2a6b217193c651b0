"""What is checked before the API sees a request: the body's size (an ASGI middleware: 413 from
the Content-Length, or as soon as a chunked body passes the limit, never read whole), the size of
the request line and headers (uvicorn's h11 protocol with the limit set, answering 431), and CORS
(off unless origins are configured).

Each refusal is OpenAI's error JSON (server/errors.py) and touches nothing else: the engine never
sees the request.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from kiln.server.errors import APIError

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]


def _too_large(limit: int, size: int | None) -> APIError:
    what = f"is {size} bytes" if size is not None else "went past that (no Content-Length)"
    return APIError(413, f"the request body {what}; this server accepts at most {limit} bytes "
                    "(--max-request-body-bytes)", code="request_too_large")


class BodyTooLarge(StarletteHTTPException):
    """Raised out of receive() when a body without a Content-Length passes the limit: FastAPI
    lets HTTP exceptions through its body parsing, and app.py answers it with `error`."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.status, error.message)
        self.error = error


class HttpLimits:
    """ASGI middleware: headers over `max_header_bytes` are answered 431, a request body over
    `limit` bytes 413 before it is read. (h11 refuses a head that does not arrive whole within
    the header limit before it is even parsed, so it is never buffered beyond that; a head that
    came in one read is measured here.)"""

    def __init__(self, app: Any, limit: int, max_header_bytes: int) -> None:
        self.app = app
        self.limit = limit
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = len(scope.get("raw_path") or b"") + sum(
            len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
        if head > self.max_header_bytes:
            await _send_error(send, _too_long_head(self.max_header_bytes))
            return
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await _send_error(send, _too_large(self.limit, int(declared)))
            return
        seen = 0

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(_too_large(self.limit, None))
            return message

        await self.app(scope, counted_receive, send)


async def _send_error(send: Any, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def _too_long_head(limit: int) -> APIError:
    return APIError(431, f"the request line and headers exceed {limit} bytes "
                    "(--max-header-bytes)", code="request_header_fields_too_large")


def h11_protocol(max_header_bytes: int) -> Any:
    """uvicorn's h11 protocol class, with a request line + headers over `max_header_bytes`
    answered 431 in OpenAI's error shape (uvicorn's own answer is a bare 400 "Invalid HTTP
    request received."). h11 is named, not "auto": httptools would not enforce the limit."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class KilnH11Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            # h11 refuses a head that outgrows its buffer limit (the config's
            # h11_max_incomplete_event_size) with "Receive buffer too long"; what is left
            # in its buffer tells that case from a malformed request.
            buffered = len(getattr(self.conn, "_receive_buffer", b""))
            if buffered <= max_header_bytes:
                super().send_400_response(msg)
                return
            err = _too_long_head(max_header_bytes)
            body = json.dumps(err.body()).encode()
            head = (b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                    b"content-type: application/json\r\nconnection: close\r\n"
                    b"content-length: " + str(len(body)).encode() + b"\r\n\r\n")
            self.transport.write(head + body)
            self.transport.close()

    return KilnH11Protocol


def uvicorn_config(app: Any, host: str, port: int, *, max_header_bytes: int,
                   drain_timeout: float) -> Any:
    """The uvicorn server every `kiln serve` runs (one model or the router): h11 with the head
    limit (h11_protocol), no access log, the drain timeout, and asyncio's event loop, named.

    Why not uvloop (measured, 2 cores, AMD EPYC Zen 3, `kiln serve` restarted for each loop,
    alternated): the engine thread hands each step's outputs over with call_soon_threadsafe.
    On asyncio's loop its self-pipe write releases the GIL and the event loop runs its part of
    the step (each stream's chunk, HTTP) at once, while the engine waits: 0.40-0.52 ms a step
    at c=1 (the MoE benchmark model). uvloop wakes its loop without releasing the GIL (0.07-0.08
    ms), so that work runs during the next step instead, on a core the step's two OpenMP threads
    need. c=1 TPOT with uvloop: Qwen2.5-Coder-0.5B 0.91x, SmolLM2 0.95x, the MoE model 1.01x;
    c=16 throughput: Qwen2.5-Coder 1.01-1.07x, but SmolLM2 0.79-1.02x (median 0.90x over 4
    rounds), whose 16-row steps are short enough for 16 streams' chunks to matter. The loss
    where compute is quickest outweighed the gains."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, loop="asyncio", log_level="warning",
                          access_log=False, timeout_graceful_shutdown=int(drain_timeout) or None,
                          http=h11_protocol(max_header_bytes),
                          h11_max_incomplete_event_size=max_header_bytes)


@dataclass(frozen=True)
class Cors:
    """CORS settings (vLLM's flag names); no origins: no CORS middleware, so browsers refuse
    cross-origin calls."""

    origins: list[str]
    methods: list[str]
    headers: list[str]
    credentials: bool = False

    @classmethod
    def from_settings(cls, s: Any) -> Cors | None:
        if not s["allowed_origins"]:
            return None
        return cls(s["allowed_origins"], s["allowed_methods"], s["allowed_headers"],
                   s["allow_credentials"])


def api_key_guard(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """The dependency that guards /v1/* (and the routes that render prompts): with a key,
    `Authorization: Bearer <key>` compared in constant time, else a 401."""

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                    api_key.encode()):
            raise APIError(401, "Missing or invalid API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")

    return check_api_key
