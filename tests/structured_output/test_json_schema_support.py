"""C53: schema features the grammar would drop are merged exactly (allOf of objects) or refused
naming them; checked on the compiled grammar, not only the schema's syntax."""

from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")

from xgrammar.testing import _is_grammar_accept_string as accepts  # noqa: E402

from pagedllm.sampling_params import StructuredOutputsParams as SO  # noqa: E402
from pagedllm.structured_output.backend_xgrammar import validate_structured_outputs  # noqa: E402
from pagedllm.structured_output.json_schema_support import supported_schema  # noqa: E402

A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
B = {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}
PYDANTIC = {"$defs": {"Base": {"title": "Base", **A}}, "title": "Child",
            "allOf": [{"$ref": "#/$defs/Base"}, B]}


def _grammar(schema):
    spec = validate_structured_outputs(SO(json=schema))
    return xgr.Grammar.from_json_schema(spec.text)


@pytest.mark.parametrize("schema", [{"allOf": [A, B]}, PYDANTIC], ids=["two-objects", "pydantic-inheritance"])
def test_multi_branch_all_of_compiles_to_the_conjunction(schema):
    g = _grammar(schema)
    assert accepts(g, '{"a":1,"b":"x"}')
    for wrong in ('123', '{"a":1}', '{"b":"x"}', '{"a":"1","b":"x"}'):  # before: any JSON (C53)
        assert not accepts(g, wrong), wrong


def test_nested_all_of_is_merged_where_it_is():
    merged = supported_schema({"type": "object", "properties": {"p": {"allOf": [A, B]}}, "required": ["p"]})
    assert merged["properties"]["p"] == {"type": "object", "properties": {"a": {"type": "integer"},
                                         "b": {"type": "string"}}, "required": ["a", "b"]}


@pytest.mark.parametrize("schema,named", [
    ({"$ref": "https://example.com/schema.json"}, "https://example.com/schema.json"),
    ({"type": "object", "properties": {"x": {"$ref": "other.json#/a"}}}, "other.json#/a"),
    ({"not": {"type": "integer"}}, "'not'"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"const": 5}}, "contains"),
    ({**A, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "'if'"),
    ({**A, "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({**A, "anyOf": [{"required": ["a"]}]}, "anyOf"),
    ({"allOf": [A, {"type": "integer"}]}, "allOf"),
    ({"allOf": [A, {"type": "object", "properties": {"a": {"type": "string"}}}]}, "'a'"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_dropped_features_are_refused_naming_them(schema, named):
    with pytest.raises(ValueError, match="structured_outputs.json") as e:
        validate_structured_outputs(SO(json=schema))
    assert named in str(e.value)


def test_keywords_as_property_names_and_single_branch_all_of_are_fine():
    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "string"}},
              "required": ["not"], "allOf": [{"required": ["if"]}]}
    spec = validate_structured_outputs(SO(json=schema))
    assert json.loads(spec.text) == schema
    g = xgr.Grammar.from_json_schema(json.dumps({"allOf": [A]}))
    assert accepts(g, '{"a":1}') and not accepts(g, '5')
