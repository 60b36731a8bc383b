"""The OpenAI error envelope, and the handlers that make every failure use it.

Every error a client can see is `{"error": {"message", "type", "param", "code"}}`, with a
4xx status for anything the client did and 500 only for real bugs (logged with their
traceback here, never sent to the client). The one exception is Anthropic's Messages API
(/v1/messages*), whose errors take Anthropic's envelope: the handlers choose it by path.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

# fastapi is imported where an error is answered, not here: the body parser's worker process
# (body_parser.py) raises these errors too, and fastapi would add ~0.4 s and ~280 modules to
# its start (measured 2026-12-04).
if TYPE_CHECKING:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import ValidationError

logger = logging.getLogger("fornax.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
# Anthropic's Messages API (server/anthropic_messages.py) answers errors in Anthropic's envelope,
# `{"type": "error", "error": {"type", "message"}}`, with Anthropic's type names: every error on
# its paths, the gate's and the validator's included, takes it here, chosen by the request's path.
# A fornax 503 (loading, draining, a stopped engine, a request ended by a shutdown) is Anthropic's
# "overloaded_error": the server cannot take it now, try again later (or elsewhere).
ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """An error answered to the client as an OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.param, self.code, self.headers = param, code, headers

    def envelope(self, path: str = "") -> dict[str, Any]:
        """The error body for a request to `path`: Anthropic's on the Messages API's paths."""
        if is_anthropic_path(path):
            return anthropic_error_body(self.status, self.message)
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, path: str = "") -> JSONResponse:
        from fastapi.responses import JSONResponse

        return JSONResponse(self.envelope(path), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error envelope; statuses it has no name for are invalid requests (4xx) or api_error."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    """Pydantic's list of errors -> one 400 naming the first offending field."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    # Unions report the branch they tried (e.g. `str`, `list[int]`): keep only real field names.
    param = ".".join(p for p in loc if not _is_type_tag(p)) or None
    msg = str(first.get("msg", "invalid value"))
    where = f"'{param}': " if param else ""
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return bad_request(f"{where}{msg}{more}", param=param)


def _is_type_tag(part: str) -> bool:
    return (
        any(c in part for c in "[]()")
        or part in {"str", "int", "float", "bool", "list", "dict"}
        or part.startswith(("function-", "constrained-", "lax-", "strict-"))
    )


def install_error_handlers(app: FastAPI) -> None:
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = {404: "no such route", 405: "method not allowed"}.get(status, str(exc.detail))
        code = {404: "unknown_url"}.get(status)
        headers = getattr(exc, "headers", None)
        return ApiError(status, message, code=code, headers=headers).response(request.url.path)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # The client left while its body was being read: no bug, and nobody to answer. Left to
        # the handler below it was logged as one (twice) and counted as a 500. 499: nginx's
        # "client closed request", as the routes answer a client gone during generation.
        return ApiError(499, "client closed the request").response(request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return ApiError(500, "internal server error", code="internal_error").response(request.url.path)
