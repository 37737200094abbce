"""What the OpenAPI document says of each route's answers, so ``/openapi.json`` is the server:
OpenAI error bodies with 400 (never FastAPI's 422), JSON or SSE bodies, Prometheus text,
the empty ``/health`` body, and the limits that are server options."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import RETRY_AFTER_S
from pagedllm.entrypoints.openai.protocol import TOKEN_ID_MARK, ErrorResponse

_ERROR_TEXT = {400: "Invalid request (the field is in error.param)", 401: "Missing or wrong API key",
               404: "Unknown model (or response id)", 500: "The request failed inside the engine",
               503: "Overloaded, shutting down, or the engine is down"}
# Before OpenAPI 3.2 (`itemSchema`), an event stream's `schema` describes one event.
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "description": "one server-sent event: `data` is a JSON chunk; the stream ends with `data: [DONE]`",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer"}}}}}


def errors(*statuses: int, model: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for error bodies (OpenAI's unless ``model`` says otherwise; 503 with Retry-After,
    401 with WWW-Authenticate)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in (*statuses, 503):
        entry: dict[str, Any] = {"model": model, "description": _ERROR_TEXT[status]}
        if status == 503:
            entry["headers"] = {"Retry-After": {"description": f"seconds ({RETRY_AFTER_S})",
                                                "schema": {"type": "integer"}}}
        if status == 401:
            entry["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
        out[status] = entry
    return out


def json_or_sse(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A 200 that is ``model`` as JSON, or server-sent events with ``stream: true``."""
    return {200: {"model": model, "description": "JSON, or server-sent events with `stream: true`",
                  "content": dict(_SSE)}}


def finish_document(doc: dict[str, Any], limits: dict[str, int], vocab_size: int,
                    max_model_len: int | None = None, has_api_key: bool = True) -> dict[str, Any]:
    """Drop FastAPI's 422 (validation errors are 400 here) and, without ``has_api_key``, the 401s; state
    ``limits`` (field name →
    maximum, from server options) on every request schema that has such a field,
    ``vocab_size - 1`` as the maximum of every token id, and the server's ``vocab_size`` and
    ``max_model_len`` where field descriptions name them (``{vocab_size}``, ``{max_model_len}``)."""
    for path in doc.get("paths", {}).values():
        for op in path.values():
            op.get("responses", {}).pop("422", None)
            if not has_api_key:
                op.get("responses", {}).pop("401", None)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for schema in schemas.values():
        for field, maximum in limits.items():
            _set_maximum(schema.get("properties", {}).get(field), maximum)
    _set_token_id_maximum(schemas, vocab_size - 1)
    numbers = {"{vocab_size}": str(vocab_size), "{max_model_len}": str(max_model_len) if max_model_len else "?"}
    for schema in schemas.values():
        for prop in schema.get("properties", {}).values():
            if "{" in prop.get("description", ""):
                for mark, value in numbers.items():
                    prop["description"] = prop["description"].replace(mark, value)
    return doc


def _set_token_id_maximum(node: Any, maximum: int) -> None:
    """Replace each token id's mark (protocol.TOKEN_ID_MARK) by ``maximum``, anywhere below ``node``."""
    if isinstance(node, dict):
        if node.pop(TOKEN_ID_MARK, False):
            node["maximum"] = maximum
        for value in node.values():
            _set_token_id_maximum(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _set_token_id_maximum(value, maximum)


def _set_maximum(prop: dict[str, Any] | None, maximum: int) -> None:
    """An integer's maximum, or the most items of a list of prompts (not of one prompt's token ids)."""
    if prop is None:
        return
    for option in prop.get("anyOf", [prop]):
        if option.get("type") == "integer":
            option["maximum"] = maximum
        elif option.get("type") == "array" and option.get("items", {}).get("type") in ("string", "array"):
            option["maxItems"] = maximum
