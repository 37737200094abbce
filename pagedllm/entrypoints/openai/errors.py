"""OpenAI-style error bodies and the exception → HTTP status mapping.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}``
with ``code`` the HTTP status; never a traceback or a Python class name in the message.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus

from fastapi.responses import JSONResponse

from pagedllm.errors import EngineDeadError, EngineOverloadedError, EngineUnhealthyError

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error with its HTTP status, raised anywhere in a handler and rendered by the app."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message or HTTPStatus(status).phrase,
                      "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


# Seconds a client should wait before retrying a 503 (overload, shutdown, engine down).
RETRY_AFTER_S = 5


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The JSON error response; a 503 carries ``Retry-After``, a 401 ``WWW-Authenticate``."""
    headers = dict(headers or {})
    if status == 503:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    elif status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def sse_error(status: int, message: str, param: str | None = None) -> str:
    """An error as one server-sent event (for failures after the stream started)."""
    return f"data: {json.dumps(error_body(status, message, param))}\n\n"


_PARAM = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\[\d+\])?\b")


def param_of(message: str, known: set[str] | None = None) -> str | None:
    """The request field a ValueError message names first (validation messages start with it)."""
    m = _PARAM.match(message)
    if m is None:
        return None
    name = m.group(1)
    if known is not None and name not in known:
        return None
    return name


def to_api_error(exc: BaseException, known_params: set[str] | None = None) -> APIError:
    """Map an exception from validation or the engine to an APIError (status + clean message)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (EngineOverloadedError, EngineDeadError, EngineUnhealthyError)):
        return APIError(503, str(exc))
    if isinstance(exc, ValueError):
        message = str(exc)
        return APIError(400, message, param_of(message, known_params))
    return APIError(500, "internal error while serving the request; see the server log")
