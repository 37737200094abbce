"""Error bodies and the exception → HTTP status mapping.

Every error leaves the server as OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (``code`` the
HTTP status), or on Anthropic's routes as ``{"type": "error", "error": {"type", "message"}}``; never a
traceback, a Python class name, a file path or a socket address in the message (``error_scrub``).
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.error_scrub import scrub
from pagedllm.errors import EngineDeadError, EngineOverloadedError, EngineUnhealthyError

ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    500: "api_error", 503: "overloaded_error"}
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
        message = scrub(message)  # no internal paths or addresses reach a client
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": scrub(message) or HTTPStatus(status).phrase,
                      "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "invalid_request_error"),
                                       "message": scrub(message) or HTTPStatus(status).phrase}}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


# Seconds a client should wait before retrying a 503 (overload, shutdown, engine down).
RETRY_AFTER_S = 5


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None, anthropic: bool = False) -> JSONResponse:
    """The JSON error response (Anthropic's shape with ``anthropic``); a 503 carries ``Retry-After``,
    a 401 ``WWW-Authenticate``."""
    headers = dict(headers or {})
    if status == 503:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    elif status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    body = anthropic_error_body(status, message) if anthropic else error_body(status, message, param)
    return JSONResponse(body, status_code=status, headers=headers)


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


# Segments pydantic adds to an error's location for the member of a union or the validator that
# failed ("constrained-str", "list[TextPart]", "function-after[...]", "str", "[key]"): not part
# of the request's path, so a client never sees them.
_UNION_TAG = re.compile(r"^(?:(?:constrained|function|lax|json|tagged|chain|nullable|default)-[\w-]+(?:\[.*\])?"
                        r"|\w+\[.*\]|str|int|float|bool|\[key\])$")


def _request_path(error: dict) -> list[str]:
    """The error's location in the request body: field names, list indices and dict keys."""
    loc = [str(p) for p in error.get("loc", ())]
    if loc and loc[0] in ("body", "query", "path", "header"):  # where it came from, not the field
        loc = loc[1:]
    return [p for p in loc if not _UNION_TAG.match(p)]


def validation_message(exc: Any) -> tuple[str, str | None]:
    """A one-line message and the offending field from a RequestValidationError: the error deepest
    in the body, the most specific one (among a union's members, the one that got furthest, and
    among equals one whose type matched: ``[]`` for a string-or-list field is a list too short). A list
    over its bound comes first: its member's type matched, so 1025 string prompts are "too many", not
    "prompt.0 is not an integer" from the token-ids member."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = max(errors, key=lambda e: (e.get("type") == "too_long", len(_request_path(e)),
                                       not str(e.get("type", "")).endswith("_type")))
    if first.get("type") == "json_invalid":
        return "Malformed JSON in the request body: " + str(first.get("ctx", {}).get("error", first.get("msg"))), None
    loc = _request_path(first)
    field = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    if first.get("type") == "missing":
        return f"{where}: field required", field
    value = first.get("input")
    shown = "" if isinstance(value, (dict, list)) else f", got {value!r}"
    return f"{where}: {first.get('msg', 'invalid value')}{shown}"[:500], field
