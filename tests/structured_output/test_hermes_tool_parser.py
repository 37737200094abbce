"""The Hermes tool-call parser: whole outputs, and streamed pieces that reassemble to them."""

from __future__ import annotations

import random

import pytest

from pagedllm.entrypoints.openai.tool_parsers import detect_tool_parser, get_tool_parser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser

TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
             '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET \\"x\\" </tool_call"}}</tool_call>')


def _stream(text: str, seed: int) -> tuple[str, list[dict]]:
    """Feed ``text`` in random pieces; reassemble content and calls from the deltas."""
    rng = random.Random(seed)
    parser = HermesToolParser()
    content, calls = "", {}
    pos = 0
    while pos < len(text):
        n = rng.randint(1, 6)
        delta = parser.extract_streaming(text[pos:pos + n], is_final=pos + n >= len(text))
        pos += n
        content += delta.content or ""
        for piece in delta.tool_calls:
            if piece.index not in calls:
                assert piece.id and piece.name, "the first piece of a call carries its id and name"
                calls[piece.index] = {"id": piece.id, "name": piece.name, "arguments": ""}
            else:
                assert piece.id is None and piece.name is None
            calls[piece.index]["arguments"] += piece.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


def test_whole_output_two_calls_and_content():
    out = HermesToolParser().extract_tool_calls(TWO_CALLS)
    assert out.content == "Let me check."
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", '{"tz": "CET \\"x\\" </tool_call"}')]
    assert all(c.id.startswith("call_") for c in out.tool_calls)


@pytest.mark.parametrize("seed", range(12))
def test_streamed_pieces_reassemble_to_the_whole_output(seed):
    whole = HermesToolParser().extract_tool_calls(TWO_CALLS)
    content, calls = _stream(TWO_CALLS, seed)
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert content.strip() == whole.content


def test_plain_text_and_invalid_calls_stay_content():
    p = HermesToolParser()
    assert p.extract_tool_calls("Just text < tool").content == "Just text < tool"
    assert p.extract_tool_calls("x").tool_calls == []
    bad = 'Hi <tool_call>{"name": "f", "arguments": {"a": </tool_call>'
    assert HermesToolParser().extract_tool_calls(bad).content == bad
    content, calls = _stream("The sign < is less than <tool", 0)
    assert content == "The sign < is less than <tool" and calls == []


def test_unterminated_call_at_end_counts_when_its_json_is_complete():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}'
    assert [(c.name, c.arguments) for c in HermesToolParser().extract_tool_calls(text).tool_calls] == [("f", '{"a": 1}')]
    (call,) = _stream(text, 3)[1]
    assert (call["name"], call["arguments"]) == ("f", '{"a": 1}')


def test_parser_registry_and_detection():
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
    assert detect_tool_parser("{% for t in tools %}<tool_call>{% endfor %}") is HermesToolParser
    assert detect_tool_parser("{{ messages }}") is None
