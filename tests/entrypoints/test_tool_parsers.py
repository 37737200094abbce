"""Every tool-call format: whole outputs and streams split at every character boundary give
the same exact calls; text before a call stays content; registry and template detection."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, detect_tool_parser, get_tool_parser

WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "zip": {"type": "string"}}}}}]

# (parser, model output as its template / published examples write it, content, [(name, arguments)])
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", '{"tz": "CET"}')]),
    ("hermes", '<tool_call>\n{"name": "write_file", "arguments": {"path": "notes.xml", '
               '"text": "close with </tool_call> here"}}\n</tool_call>',
     None, [("write_file", '{"path": "notes.xml", "text": "close with </tool_call> here"}')]),
    ("hermes", '<tool_call>\n{"arguments": {"a": "}"}, "name": "f"}\n</tool_call>', None, [("f", '{"a": "}"}')]),
    ("llama3_json", '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
                    '"unit": "Fahrenheit"}}',
     None, [("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')]),
    ("llama3_json", 'Sure.<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
     "Sure.", [("a", '{"x": 1}'), ("b", "{}")]),
    ("mistral", '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
                '"format": "celsius"}}, {"name": "f", "arguments": {}}]',
     None, [("get_current_weather", '{"location": "Paris, France", "format": "celsius"}'), ("f", "{}")]),
    ("mistral", 'I will look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
     "I will look.", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]),
    ("pythonic", '[get_weather(city="San Francisco", metric="celsius"), get_time(tz="PST", n=[1, 2.5], ok=True)]',
     None, [("get_weather", '{"city": "San Francisco", "metric": "celsius"}'),
            ("get_time", '{"tz": "PST", "n": [1, 2.5], "ok": true}')]),
    ("pythonic", 'Calling now: <|python_start|>[f(a=1, b="x]")]<|python_end|>', "Calling now:",
     [("f", '{"a": 1, "b": "x]"}')]),
    ("qwen3_coder", 'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                    '<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n'
                    '</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>',
     "Checking.", [("get_weather", '{"city": "Paris", "days": 3, "zip": "75001"}'), ("get_time", "{}")]),
]
IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


def _parser(name: str):
    return get_tool_parser(name)(WEATHER_TOOLS)


def _stream(name: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed ``pieces``; reassemble content and calls from the deltas, checking the first-piece rule."""
    parser = _parser(name)
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        delta = parser.extract_streaming(piece, is_final=k == len(pieces) - 1)
        content += delta.content or ""
        for p in delta.tool_calls:
            if p.index not in calls:
                assert p.id and p.id.startswith("call_") and p.name, "a call's first piece carries id and name"
                calls[p.index] = [p.name, ""]
            else:
                assert p.id is None and p.name is None
            calls[p.index][1] += p.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("name,text,content,expected", CASES, ids=IDS)
def test_whole_output(name, text, content, expected):
    out = _parser(name).extract_tool_calls(text)
    assert out.content == content
    assert [(c.name, c.arguments) for c in out.tool_calls] == expected
    assert all(isinstance(json.loads(c.arguments), dict) for c in out.tool_calls)


@pytest.mark.parametrize("name,text,content,expected", CASES, ids=IDS)
def test_stream_one_character_at_a_time(name, text, content, expected):
    streamed_content, calls = _stream(name, list(text))
    assert calls == expected
    assert (streamed_content.strip() or None) == content


@pytest.mark.parametrize("name,text,content,expected", CASES, ids=IDS)
def test_stream_split_at_every_boundary(name, text, content, expected):
    for cut in range(1, len(text)):
        streamed_content, calls = _stream(name, [text[:cut], text[cut:]])
        assert calls == expected, cut
        assert (streamed_content.strip() or None) == content, cut


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_plain_text_stays_content(name):
    for text in ["Just text, no call: [1, 2] {x} <b>", "The sign < is less than <tool", "[see above]"]:
        assert _parser(name).extract_tool_calls(text).content == text
        assert _stream(name, list(text)) == (text, [])


@pytest.mark.parametrize("name,text", [
    ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {"a": </tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": '),
    ("pythonic", "[f(1, 2)]"),
    ("pythonic", "[f(a=open('x'))]"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1"),
])
def test_invalid_or_unfinished_calls_stay_content(name, text):
    out = _parser(name).extract_tool_calls(text)
    assert out.tool_calls == [] and out.content == text


@pytest.mark.parametrize("name,text,expected", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}', [("f", '{"a": 1}')]),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "par', [("f", '{"a": 1}')]),
    ("pythonic", '[f(a=1), g(b=', [("f", '{"a": 1}')]),
    ("qwen3_coder", "<tool_call>\n<function=f>\n</function>\n<tool_call>\n<function=g>", [("f", "{}")]),
])
def test_a_cut_output_keeps_its_complete_calls(name, text, expected):
    assert [(c.name, c.arguments) for c in _parser(name).extract_tool_calls(text).tool_calls] == expected


def test_arguments_stream_as_fragments_before_the_call_ends():
    for name, text in [("hermes", '<tool_call>{"name": "f", "arguments": {"a": "long text", "b": 2}}</tool_call>'),
                       ("qwen3_coder", "<function=f>\n<parameter=a>\nx\n</parameter>\n<parameter=b>\ny\n</parameter>"
                                       "\n</function>")]:
        parser = _parser(name)
        fragments = [p.arguments for ch in text for p in parser.extract_streaming(ch).tool_calls if p.arguments]
        assert len(fragments) >= 3, name


def test_registry_and_template_detection():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"}
    with pytest.raises(ValueError, match="llama3_json"):
        get_tool_parser("nope")
    templates = {
        "hermes": "{{- '<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n"
                  "</tool_call>' }}",
        "qwen3_coder": "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>",
        "mistral": "{{- '[AVAILABLE_TOOLS]' }}{%- if message.tool_calls %}{{- '[TOOL_CALLS]' }}",
        "llama3_json": 'Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                       'its value}.',
        "pythonic": "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]",
    }
    for name, template in templates.items():
        assert detect_tool_parser(template) is TOOL_PARSERS[name], name
    assert detect_tool_parser("{{ messages }}") is None
