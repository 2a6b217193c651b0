"""Every error the HTTP API returns, in OpenAI's shape `{"error": {message, type, param, code}}`.

Errors are mapped here and only here: APIError carries its status; request validation, engine
exceptions and Starlette's own HTTP errors are translated by the functions below and the handlers
that server/app.py installs.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from kiln.errors import KilnError
from kiln.i18n import english
from kiln.sampling_params import SamplingParamsError
from kiln.server.protocol import REFUSAL_CODES, ErrorInfo, ErrorResponse
from kiln.tokenizer import TokenizerError

_STATUS_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# The `code` of an error raised without one, by its status: every error body carries a code a
# client (and a test) can match instead of the message's wording. Raisers give a narrower one
# where it helps (model_not_found, context_length_exceeded, invalid_json, ...).
_STATUS_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    431: "request_header_fields_too_large",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with its HTTP status, rendered in OpenAI's error shape; `code` is never None
    (the status's own code when the raiser gave none)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or _STATUS_CODES.get(status, "error")
        self.type = type_ or _STATUS_TYPES.get(status, "APIError")

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class ClientGone(Exception):
    """The client disconnected before the response was ready; nothing is sent."""


def bad_param(e: SamplingParamsError | TokenizerError, param: str | None = None) -> APIError:
    if isinstance(e, SamplingParamsError):
        return APIError(400, e.message, param=e.param, code=e.code)
    return APIError(400, e.message, param=param, code="invalid_value")


def engine_error(e: BaseException) -> BaseException:
    """The HTTP error for an exception out of the engine (itself when it is not one)."""
    from kiln.engine.async_engine import EngineDeadError, EngineOverloadedError
    from kiln.engine.engine import StepFailedError

    if isinstance(e, StepFailedError):
        # The model step this request was in raised; other requests were not touched.
        return APIError(500, e.message, code="engine_step_failed")
    if isinstance(e, EngineOverloadedError):
        return APIError(503, e.message, code="overloaded")
    if isinstance(e, EngineDeadError):
        return APIError(503, e.message, code="engine_dead")
    if isinstance(e, SamplingParamsError):
        # add_request's checks of a sampling field (an output constraint that does not compile)
        return bad_param(e)
    if isinstance(e, KilnError):
        # add_request's own validation (the routes check the same things first, so rare).
        return APIError(400, english(e.message), code=e.code or "invalid_value")
    return e


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    # loc = ("body", "messages", 0, "content", ...): the top-level field is the OpenAI param.
    parts = [p for p in loc if p != "body"]
    return str(parts[0]) if parts and isinstance(parts[0], str) else None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        why = detail.get("ctx", {}).get("error", detail.get("msg", ""))
        return APIError(400, f"Malformed JSON in the request body: {why}", code="invalid_json")
    if not errors:
        return APIError(400, "invalid request", code="invalid_value")
    first = errors[0]
    param = _validation_param(tuple(first.get("loc", ())))
    if param is None and len(tuple(first.get("loc", ()))) <= 1:
        # The body itself is missing or not an object.
        return APIError(400, f"Invalid request body: {first.get('msg')}", code="invalid_value")
    # Only the errors about the same top-level field, so a union's alternatives don't drown it.
    same = [e for e in errors if _validation_param(tuple(e.get("loc", ()))) == param]
    # Our own refusals (protocol.refusal: their type is their code) beat a union's "not a string".
    ours = [e for e in same if e.get("type") in REFUSAL_CODES]
    msgs = []
    for e in ours or same:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        msgs.append(f"{where}: {msg}")
    code = ours[0]["type"] if ours else "invalid_value"
    return APIError(400, "; ".join(dict.fromkeys(msgs[:4])), param=param, code=code)
