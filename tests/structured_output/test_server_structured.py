"""Structured outputs and tool calls through the server, with the ``openai`` client and the
real SmolLM2 (greedy, so streamed and non-streamed runs produce the same text).

SmolLM2's own template has no tool format, so the server runs with a Hermes-style chat
template (the Qwen 2.5 layout: tools listed in the system turn, calls in ``<tool_call>``
tags) and ``tool_call_parser="hermes"``.
"""

from __future__ import annotations

import json

import openai
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from pagedllm.engine.async_engine import AsyncLLMEngine  # noqa: E402
from pagedllm.entrypoints.openai.api_server import build_app  # noqa: E402
from pagedllm.metrics import EngineMetrics  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402
from server_utils import ServerThread  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You are a function calling AI model. You may call one or more functions. Here are the available tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object with function name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}},
]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "hobbies"]}


@pytest.fixture(scope="module")
def served(smollm2_path):
    from pagedllm import LLM

    llm = LLM(model=str(smollm2_path), max_model_len=768, kv_cache_memory="128MiB", seed=0)
    engine = AsyncLLMEngine(llm.llm_engine, metrics=EngineMetrics(MODEL), stats_log_interval_s=0)
    app = build_app(engine, [MODEL], chat_template=HERMES_TEMPLATE, tool_call_parser="hermes")
    with ServerThread(app) as srv:
        srv.llm = llm
        yield srv


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _stream_chat(client, **kw):
    """Reassemble a streamed chat answer: (content, [(id, name, arguments)], finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            # every chunk carries something (no empty deltas while a tool call is held back)
            assert ch.delta.content is not None or ch.delta.tool_calls or ch.finish_reason or ch.logprobs, chunk
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function.name and tc.type == "function"
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                calls[tc.index][2] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_chat_response_format_json_schema_validates_and_streams_the_same(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Invent a person and describe them."}],
              temperature=0, max_tokens=80, response_format={
                  "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    resp = client.chat.completions.create(**kw)
    text = resp.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert resp.choices[0].finish_reason == "stop"
    assert _stream_chat(client, **kw)[0] == text


def test_completions_vllm_extra_fields(client):
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                     extra_body={"guided_choice": ["Paris", "London", "Rome"]})
    assert resp.choices[0].text in ("Paris", "London", "Rome")
    resp = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=16, temperature=0,
                                     extra_body={"structured_outputs": {"regex": r"\d{3}-\d{3}-\d{4}"}})
    assert len(resp.choices[0].text) == 12 and resp.choices[0].text[3] == "-"
    resp = client.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=80, temperature=0,
                                     extra_body={"response_format": {"type": "json_schema",
                                                                     "json_schema": {"name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(resp.choices[0].text), PERSON)


def test_named_tool_choice_is_a_valid_call_and_template_gets_the_tools(client, served):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    resp = client.chat.completions.create(**kw)
    ((name, args),) = _calls(resp.choices[0].message)
    assert name == "get_weather" and resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(args), WEATHER)
    # The prompt is the template rendered with the tools.
    engine = served.llm.llm_engine
    ids = engine.apply_chat_template(ASK, chat_template=HERMES_TEMPLATE, tools=TOOLS)
    assert '"get_time"' in engine.tokenizer.decode(ids)
    assert resp.usage.prompt_tokens == len(ids)
    content, calls, finish = _stream_chat(client, **kw)
    assert [(n, a) for _, n, a in calls] == [(name, args)] and finish == "stop" and content == ""


def test_required_tool_choice_gives_valid_calls_streamed_the_same(client):
    # parallel_tool_calls=False: exactly one call (SmolLM2 would otherwise keep adding calls).
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80, tool_choice="required",
              parallel_tool_calls=False)
    resp = client.chat.completions.create(**kw)
    calls = _calls(resp.choices[0].message)
    assert len(calls) == 1 and resp.choices[0].finish_reason == "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, args in calls:
        jsonschema.validate(json.loads(args), schemas[name])
    _, streamed, finish = _stream_chat(client, **kw)
    assert [(n, a) for _, n, a in streamed] == calls and finish == "tool_calls"


def test_auto_tool_choice_parses_hermes_calls_stream_and_non_stream(client):
    # Force the model's text into the Hermes format to exercise the parser on real output.
    forced = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", "unit": "celsius"\}\}\n</tool_call>'
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
              extra_body={"structured_outputs": {"regex": forced}})
    resp = client.chat.completions.create(**kw)
    ((name, args),) = _calls(resp.choices[0].message)
    assert name == "get_weather" and json.loads(args)["unit"] == "celsius"
    assert resp.choices[0].finish_reason == "tool_calls" and resp.choices[0].message.content is None
    content, streamed, finish = _stream_chat(client, **kw)
    assert [(n, a) for _, n, a in streamed] == [(name, args)] and finish == "tool_calls"


def test_auto_tool_choice_without_a_call_is_plain_content(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello to Anna in one sentence."}], tools=TOOLS,
              temperature=0, max_tokens=24)
    ref = client.chat.completions.create(tool_choice="none", **kw).choices[0]  # same prompt, text not parsed
    assert "<tool_call>" not in ref.message.content
    resp = client.chat.completions.create(**kw).choices[0]
    assert resp.message.content == ref.message.content and not resp.message.tool_calls
    assert resp.finish_reason == ref.finish_reason


def test_multi_turn_with_tool_results_renders(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=16)
    assert resp.choices[0].message.content and not resp.choices[0].message.tool_calls


@pytest.mark.parametrize("kw,param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
     "response_format"),
    (dict(extra_body={"guided_regex": "[a-"}), "guided_regex"),
    (dict(extra_body={"guided_choice": []}), "guided_choice"),
    (dict(tools=[{"type": "function", "function": {"parameters": WEATHER}}]), "tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_stock"}}), "tool_choice"),
])
def test_bad_input_is_a_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
