"""Reasoning, every tool-call format, template kwargs and the contract rows through the server,
with the ``openai`` client and the real SmolLM2. Model output is forced into each format with a
regex (greedy), so the parsers see real generated text, streamed and not.

The server's chat template is Qwen3-shaped: ``<think>`` closed in the prompt when
``enable_thinking`` is false, tools in Hermes ``<tool_call>`` tags, ``greeting`` and
``reasoning_effort`` written into a system turn when given.
"""

from __future__ import annotations

import dataclasses
import json
import re

import httpx
import openai
import pytest

pytest.importorskip("xgrammar")

from pagedllm.engine.async_engine import AsyncLLMEngine  # noqa: E402
from pagedllm.entrypoints.openai.api_server import build_app  # noqa: E402
from pagedllm.metrics import EngineMetrics  # noqa: E402
from server_utils import ServerThread  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TEMPLATE = """{%- if greeting is defined %}<|im_start|>system
{{ greeting }}{% if reasoning_effort is defined %} effort={{ reasoning_effort }}{% endif %}<|im_end|>
{% endif %}
{%- if tools %}<|im_start|>system
Call tools as <tool_call>{"name": ..., "arguments": ...}</tool_call>: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
THINK = r"<think>\nI think [a-z ]{5,30}\n</think>\n\nAnswer: [A-Z][a-z]{2,8}\."
FORMATS = {
    "hermes": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}"\}\}\n</tool_call>',
    "llama3_json": r'\{"name": "get_weather", "parameters": \{"city": "[A-Z][a-z]{2,9}"\}\}',
    "mistral": r'\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "[A-Z][a-z]{2,9}"\}',
    "pythonic": r'\[get_weather\(city="[A-Z][a-z]{2,9}"\)\]',
    "qwen3_coder": r"<tool_call>\n<function=get_weather>\n<parameter=city>\n[A-Z][a-z]{2,9}\n</parameter>\n"
                   r"</function>\n</tool_call>",
}


@pytest.fixture(scope="module")
def llm(smollm2_path, tmp_path_factory):
    from pagedllm import LLM

    folder = tmp_path_factory.mktemp("generation_config")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "eos_token_id": 2}))
    return LLM(model=str(smollm2_path), max_model_len=768, kv_cache_memory="128MiB", seed=0,
               reasoning_parser="qwen3", generation_config=str(folder),
               structured_outputs_config='{"enable_in_reasoning": true}',  # the grammars below write the block
               default_chat_template_kwargs='{"greeting": "Bonjour"}')


def _serve(llm, tool_call_parser: str = "hermes") -> ServerThread:
    engine = AsyncLLMEngine(llm.llm_engine, metrics=EngineMetrics(MODEL), stats_log_interval_s=0)
    return ServerThread(build_app(engine, [MODEL], chat_template=TEMPLATE, tool_call_parser=tool_call_parser))


@pytest.fixture(scope="module")
def served(llm):
    with _serve(llm) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _stream(client, **kw) -> dict:
    """A streamed chat answer reassembled: reasoning, content, calls, finish_reason, chunks."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "chunks": []}
    for chunk in client.chat.completions.create(stream=True, **kw):
        out["chunks"].append(chunk)
        for ch in chunk.choices:
            delta = ch.delta.model_dump()
            out["reasoning"] += delta.get("reasoning_content") or ""
            assert delta.get("reasoning") == delta.get("reasoning_content")
            out["content"] += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                out["calls"].setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
            out["finish"] = ch.finish_reason or out["finish"]
    out["calls"] = [tuple(out["calls"][i]) for i in sorted(out["calls"])]
    return out


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_reasoning_is_split_streamed_and_not(client):
    kw = dict(model=MODEL, messages=ASK, max_tokens=80, extra_body={"structured_outputs": {"regex": THINK}})
    resp = client.chat.completions.create(**kw)
    msg = resp.choices[0].message.model_dump()
    assert msg["reasoning_content"].startswith("I think ") and msg["reasoning"] == msg["reasoning_content"]
    assert msg["content"].startswith("Answer: ") and "<think>" not in msg["content"]
    details = resp.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < resp.usage.completion_tokens
    streamed = _stream(client, **kw, stream_options={"include_usage": True})
    assert (streamed["reasoning"], streamed["content"]) == (msg["reasoning_content"], msg["content"])
    assert streamed["chunks"][-1].usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


def test_a_length_cut_inside_reasoning_returns_it_with_an_empty_answer(client):
    kw = dict(model=MODEL, messages=ASK, max_tokens=10, extra_body={"structured_outputs": {"regex": THINK}})
    resp = client.chat.completions.create(**kw)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.content == ""
    assert choice.message.model_dump()["reasoning_content"].startswith("I think")
    assert resp.usage.completion_tokens_details.reasoning_tokens == resp.usage.completion_tokens == 10
    streamed = _stream(client, **kw)
    assert streamed["reasoning"] == choice.message.model_dump()["reasoning_content"] and streamed["content"] == ""


def test_by_default_the_grammar_starts_after_the_reasoning(llm, monkeypatch):
    """vLLM's default (enable_in_reasoning false): a prompt left inside ``<think>`` reasons freely, the
    constrained output equals the unconstrained one; thinking switched off, the grammar holds at once."""
    config = llm.llm_engine.config
    monkeypatch.setattr(llm.llm_engine, "config", dataclasses.replace(config, structured_outputs_config=None))
    with _serve(llm) as srv:
        monkeypatch.setattr(llm.llm_engine, "config", config)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        thinking = ASK + [{"role": "assistant", "content": "<think>\n"}]
        kw = dict(model=MODEL, messages=thinking, max_tokens=12, extra_body={"continue_final_message": True,
                                                                            "add_generation_prompt": False})
        free = client.chat.completions.create(**kw).choices[0]
        regex = {"structured_outputs": {"regex": r"Answer: [A-Z][a-z]{2,8}\."}}
        constrained = client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], **regex}}).choices[0]
        assert constrained.message.model_dump()["reasoning_content"] == free.message.model_dump()["reasoning_content"]
        assert constrained.message.content == "" and constrained.finish_reason == "length"
        off = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, extra_body={
            **regex, "chat_template_kwargs": {"enable_thinking": False}}).choices[0]
        assert re.fullmatch(r"Answer: [A-Z][a-z]{2,8}\.", off.message.content) and off.finish_reason == "stop"


def test_template_kwargs_reach_the_template_in_chat_and_tokenize(served, client):
    def rendered(body):
        r = httpx.post(served.url + "/tokenize", json={"model": MODEL, "messages": ASK, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return httpx.post(served.url + "/detokenize", json={"model": MODEL, "tokens": r.json()["tokens"]},
                          timeout=60).json()["prompt"]

    assert rendered({}).startswith("<|im_start|>system\nBonjour<|im_end|>")  # the server's default kwargs
    assert "Salut effort=high" in rendered({"chat_template_kwargs": {"greeting": "Salut"}, "reasoning_effort": "high"})
    off = rendered({"chat_template_kwargs": {"enable_thinking": False}})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and "<think>" not in rendered({})
    kw = dict(model=MODEL, messages=ASK, max_tokens=8, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    resp = client.chat.completions.create(**kw)
    assert resp.choices[0].message.content and "reasoning_content" not in resp.choices[0].message.model_dump()
    assert resp.usage.prompt_tokens > client.chat.completions.create(**{**kw, "extra_body": {}}).usage.prompt_tokens


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_each_tool_format_is_parsed_under_auto_stream_and_not(llm, parser):
    with _serve(llm, parser) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60,
                  extra_body={"structured_outputs": {"regex": FORMATS[parser]}})
        resp = client.chat.completions.create(**kw)
        ((name, args),) = _calls(resp.choices[0].message)
        assert name == "get_weather" and set(json.loads(args)) == {"city"}
        assert resp.choices[0].finish_reason == "tool_calls" and not resp.choices[0].message.content
        streamed = _stream(client, **kw)
        assert streamed["calls"] == [(name, args)] and streamed["finish"] == "tool_calls"


def test_hermes_end_tag_inside_an_argument_string_is_text(client):
    text = '{"path": "notes.xml", "text": "close with </tool_call> here"}'
    forced = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"path": "notes\.xml", "text": "close with '
              r'</tool_call> here"\}\}\n</tool_call>')
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120,
              extra_body={"structured_outputs": {"regex": forced}})
    resp = client.chat.completions.create(**kw)
    assert _calls(resp.choices[0].message) == [("get_weather", text)] and resp.choices[0].finish_reason == "tool_calls"
    streamed = _stream(client, **kw)
    assert streamed["calls"] == [("get_weather", text)] and streamed["content"] == ""


def test_required_streams_arguments_as_generated_and_a_cut_call_is_kept(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=60)
    resp = client.chat.completions.create(**kw)
    ((name, args),) = _calls(resp.choices[0].message)
    streamed = _stream(client, **kw)
    fragments = [tc for c in streamed["chunks"] for ch in c.choices for tc in ch.delta.tool_calls or []
                 if tc.function.arguments]
    assert streamed["calls"] == [(name, args)] and len(fragments) >= 3
    cut = client.chat.completions.create(**{**kw, "max_tokens": 14})
    ((cut_name, cut_args),) = _calls(cut.choices[0].message)
    assert cut.choices[0].finish_reason == "length" and cut_name == name and args.startswith(cut_args)
    assert _stream(client, **{**kw, "max_tokens": 14})["calls"] == [(cut_name, cut_args)]
    named = {**kw, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 5}
    cut = client.chat.completions.create(**named).choices[0]
    ((cut_name, cut_args),) = _calls(cut.message)
    assert cut.finish_reason == "length" and cut_name == "get_weather" and cut_args.startswith("{")


def test_continuous_usage_stats_put_usage_in_every_chunk(client, served):
    chunks = _stream(client, model=MODEL, messages=ASK, max_tokens=6,
                     stream_options={"continuous_usage_stats": True, "include_usage": True})["chunks"]
    counts = [c.usage.completion_tokens for c in chunks[1:-1]]
    assert all(c.usage is not None for c in chunks[1:]) and counts == sorted(counts) and counts[-1] == 6
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [e["usage"]["completion_tokens"] for e in events] == [1, 2, 3, 4]


def test_generation_config_defaults_apply_when_a_request_omits_the_field(client):
    kw = dict(model=MODEL, messages=ASK, max_tokens=12)
    greedy = client.chat.completions.create(temperature=0, **kw).choices[0].message.content
    assert [client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2)] == [greedy] * 2
    sampled = {client.chat.completions.create(seed=s, temperature=1.5, **kw).choices[0].message.content
               for s in (1, 2, 3)}
    assert sampled != {greedy}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_at_temperature_one_ends_with_valid_json(client, seed):
    person = {"type": "object", "properties": {"name": {"type": "string"},
              "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], temperature=1.0, seed=seed,
        max_tokens=300, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person}})
    value = json.loads(resp.choices[0].message.content)
    assert set(value) == {"name", "age"} and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 150
