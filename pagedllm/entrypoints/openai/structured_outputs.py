"""Request fields that constrain the output, translated to StructuredOutputsParams.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``), vLLM's ``structured_outputs`` object
and its older ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar``: at most one per request. Each
problem is a 400 naming the field, found before the engine: compiled at grammar level here (milliseconds), against
the tokenizer in the engine, off its step loop.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend_xgrammar import validate_structured_outputs


def structured_outputs_of(req: Any) -> StructuredOutputsParams | None:
    """The constraint of a request carrying the fields above (``response_format``,
    ``structured_outputs``, ``guided_*``), validated, or None. Raises APIError(400) naming the field."""
    found = [(name, params) for name, params in _requested(req) if params is not None]
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise APIError(400, f"{names} cannot be combined: give one output constraint", found[1][0].split(".")[0])
    if not found:
        return None
    name, params = found[0]
    check_constraint(params, name)
    return params


def check_constraint(params: StructuredOutputsParams, field: str) -> None:
    """Validate ``params`` at grammar level; raise APIError(400) whose message and param name ``field``."""
    try:
        validate_structured_outputs(params)
    except ValueError as e:
        message = str(e).replace(f"structured_outputs.{params.kind}", field, 1)
        raise APIError(400, message, field.split(".")[0].split("[")[0]) from None
    except ImportError as e:
        raise APIError(400, f"{field}: structured outputs are not available on this server ({e})",
                       field.split(".")[0]) from None


def _requested(req: Any) -> list[tuple[str, StructuredOutputsParams | None]]:
    rf = getattr(req, "response_format", None)
    if isinstance(rf, BaseModel):
        rf = rf.model_dump()
    out = [("response_format.json_schema.schema", _from_response_format(rf))]
    if getattr(req, "structured_outputs", None) is not None:
        out.append(("structured_outputs", _build("structured_outputs", **req.structured_outputs)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, name, None)
        if value is not None:
            out.append((name, _build(name, **{kind: value})))
    return out


def _build(field: str, **kwargs: Any) -> StructuredOutputsParams:
    if "reasoning_boundary" in kwargs:
        raise APIError(400, f"{field}.reasoning_boundary is set by the server's reasoning parser "
                       "(--structured-outputs-config)", field)
    try:
        return StructuredOutputsParams(**kwargs)
    except TypeError as e:  # an unknown key in the structured_outputs object
        raise APIError(400, f"{field}: {e}".replace("StructuredOutputsParams.__init__() ", ""), field) from None
    except ValueError as e:
        raise APIError(400, str(e).replace("structured_outputs", field, 1), field) from None


def _from_response_format(rf: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise APIError(400, f"response_format.type must be one of 'text', 'json_object', 'json_schema'; got {kind!r}",
                       "response_format")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise APIError(400, "response_format.json_schema must be an object with a non-empty 'name' (and a 'schema')",
                       "response_format")
    schema = spec.get("schema")
    if schema is None:
        return StructuredOutputsParams(json_object=True)
    if not isinstance(schema, dict):
        raise APIError(400, f"response_format.json_schema.schema must be a JSON schema object, got {schema!r}",
                       "response_format")
    return StructuredOutputsParams(json=schema)
