"""Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens`` against a scripted fake engine: each request
field reaches the chat path (or is a 400 in Anthropic's error shape), content blocks, ``stop_reason``, usage
with cache reads, the streamed events, the API key headers, engine failure and disconnect."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from api_fakes import MODEL, scripted_server, scripted_serving, sse_typed_events, wait_until_free

TOOLS = [{"name": "get_weather", "description": "weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served():
    with scripted_serving() as srv:
        yield srv


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served.url, timeout=10, headers={"anthropic-version": "2023-06-01"}) as c:
        yield c


def create(client, fake, script: str | None = None, **body) -> dict:
    if script is not None:
        fake.script = [script]
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 64, "messages": HI, **body})
    assert r.status_code == 200, r.text
    return r.json()


def assert_anthropic_error(r: httpx.Response, status: int, words: str = "") -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == {400: "invalid_request_error", 401: "authentication_error",
                                     404: "not_found_error", 500: "api_error"}[status]
    assert words in body["error"]["message"] and "Traceback" not in r.text
    return body["error"]["message"]


def test_text_message_end_turn_and_usage(served, client):
    fake = served.fake
    body = create(client, fake, "Hello.", system="Be brief.", temperature=0.3, top_p=0.8, top_k=5,
                  metadata={"user_id": "u1"})
    assert body["type"] == "message" and body["role"] == "assistant" and body["id"].startswith("msg_")
    assert body["content"] == [{"type": "text", "text": "Hello."}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("end_turn", None)
    prompt = fake.prompt_seen[-1]
    usage = body["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(prompt) and usage["output_tokens"] == 6
    assert fake.conversations[-1][0] == {"role": "system", "content": "Be brief."}
    p = fake.last_params
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.3, 0.8, 5, 64)


def test_cache_read_input_tokens_from_the_prefix_cache(served, client):
    fake = served.fake
    long = [{"role": "user", "content": "a long shared question " * 3}]
    create(client, fake, "x", messages=long)
    again = create(client, fake, "x", messages=long)["usage"]
    assert again["cache_read_input_tokens"] > 0 and again["cache_creation_input_tokens"] == 0
    assert again["input_tokens"] + again["cache_read_input_tokens"] == len(fake.prompt_seen[-1])


def test_max_tokens_and_stop_sequence(served, client):
    assert create(client, served.fake, "abcdef", max_tokens=2)["stop_reason"] == "max_tokens"
    body = create(client, served.fake, "one. two", stop_sequences=["."])
    assert (body["stop_reason"], body["stop_sequence"], body["content"][0]["text"]) == ("stop_sequence", ".", "one")


def test_system_blocks_tool_use_and_tool_result_become_the_conversation(served, client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "t", "signature": "s"},
                    {"type": "text", "text": "checking"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "and?"}]}]
    create(client, served.fake, "ok", system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
           messages=messages, tools=TOOLS, tool_choice={"type": "none"})
    conv = served.fake.conversations[-1]
    assert [m["role"] for m in conv] == ["system", "user", "assistant", "tool", "user"]
    assert conv[0]["content"] == "A\nB" and conv[2]["content"] == "checking"
    call = conv[2]["tool_calls"][0]
    assert call["id"] == "toolu_1" and call["function"]["arguments"] == {"city": "Paris"}  # the template sees an object
    assert conv[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}


def test_tool_choice_any_gives_tool_use_with_input_object(served, client):
    fake = served.fake
    body = create(client, fake, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', tools=TOOLS,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (block,) = body["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {"city": "Oslo"}
    assert body["stop_reason"] == "tool_use" and fake.last_params.structured_outputs.json["maxItems"] == 1
    assert fake.tools_seen[-1][0]["function"]["parameters"] == TOOLS[0]["input_schema"]


def test_tool_choice_tool_and_none(served, client):
    fake = served.fake
    body = create(client, fake, '{"city": "Rome"}', tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    assert body["content"][0]["input"] == {"city": "Rome"} and body["stop_reason"] == "tool_use"
    assert fake.last_params.structured_outputs.json == TOOLS[0]["input_schema"]
    body = create(client, fake, "plain", tools=TOOLS, tool_choice={"type": "none"})
    assert body["content"] == [{"type": "text", "text": "plain"}] and fake.last_params.structured_outputs is None


def test_output_config_format_and_thinking(served, client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    body = create(client, served.fake, '{"n": 1}', output_config={"format": {"type": "json_schema", "schema": schema}},
                  thinking={"type": "enabled", "budget_tokens": 1024})
    assert served.fake.last_params.structured_outputs.json == schema
    assert [b["type"] for b in body["content"]] == ["text"]  # no reasoning parser: no thinking blocks
    create(client, served.fake, "x", thinking={"type": "disabled"})


@pytest.mark.parametrize("body, words", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "block type 'video'"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**6}, "context"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "custom tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"tools": TOOLS, "tool_choice": {"type": "maybe"}}, "tool_choice.type"),
    ({"tools": TOOLS}, "tool-call parser"),  # auto: the fake's template teaches no tool-call format
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"output_config": {"format": {"type": "regex"}}}, "output_config.format"),
    ({"stream": 1}, "stream"),
    *[({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": c}]}]},
       words) for c, words in ((5, "content[0].content must be a string"), ([5], "block type None"),
                               ([{"type": "image", "source": {}}], "image blocks"))],
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "r"}]}]}, "needs tool_use_id"),
    *[({"messages": [{"role": "assistant", "content": [{"type": "tool_use", **block}]}, *HI]},
       "messages[0].content[0]: a tool_use block needs id and name")
      for block in ({"name": "f", "input": {}}, {"id": "t", "input": {}}, {"id": "t", "name": "f", "input": [1]})],
])
def test_bad_fields_are_400_in_anthropic_shape(client, body, words):
    assert_anthropic_error(client.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": HI, **body}),
                           400, words)


def test_unknown_model_and_missing_max_tokens(client):
    assert_anthropic_error(client.post("/v1/messages", json={"model": "claude-x", "max_tokens": 8, "messages": HI}),
                           404, "claude-x")
    assert_anthropic_error(client.post("/v1/messages", json={"model": MODEL, "messages": HI}), 400,
                           "max_tokens: field required")
    assert_anthropic_error(client.post("/v1/messages", content=b"{bad",
                                       headers={"content-type": "application/json"}), 400, "Malformed JSON")


def test_count_tokens_equals_the_prompt_of_create(served, client):
    body = {"model": MODEL, "system": "S", "messages": HI, "tools": TOOLS, "tool_choice": {"type": "any"}}
    r = client.post("/v1/messages/count_tokens", json=body)
    assert r.status_code == 200, r.text
    create(client, served.fake, '[{"name": "get_weather", "parameters": {"city": "x"}}]', **body)
    assert r.json() == {"input_tokens": len(served.fake.prompt_seen[-1])}
    assert_anthropic_error(client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image"}]}]}), 400, "image")


def test_stream_text_events(served, client):
    served.fake.script = ["abc"]
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 16, "messages": HI, "stream": True})
    events = sse_typed_events(r.text)
    assert [n for n, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                      "content_block_delta", "content_block_delta", "content_block_stop",
                                      "message_delta", "message_stop"]
    assert all(n == d["type"] for n, d in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == len(served.fake.prompt_seen[-1])
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == "abc"
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 3


def test_stream_tool_use_events(served, client):
    served.fake.script = ['{"city": "Oslo"}']
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 64, "messages": HI, "stream": True,
                                          "tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}})
    events = sse_typed_events(r.text)
    block = events[2][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"input_json_delta"}
    assert json.loads("".join(d["partial_json"] for d in deltas)) == {"city": "Oslo"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use" and events[-1][0] == "message_stop"


def test_api_key_as_x_api_key_or_bearer():
    srv, fake = scripted_server(app_api_key="K")
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        body = {"model": MODEL, "max_tokens": 2, "messages": HI}
        assert c.post("/v1/messages", json=body, headers={"x-api-key": "K"}).status_code == 200
        assert c.post("/v1/messages", json=body, headers={"Authorization": "Bearer K"}).status_code == 200
        assert c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1},
                      headers={"x-api-key": "K"}).status_code == 200
        assert_anthropic_error(c.post("/v1/messages", json=body, headers={"x-api-key": "nope"}), 401, "API key")
        assert_anthropic_error(c.post("/v1/messages/count_tokens", json=body), 401)
        assert c.post("/v1/responses", json={"input": "hi"}).json()["error"]["code"] == 401  # OpenAI's shape there


def test_engine_failure_is_api_error_or_error_event():
    srv, fake = scripted_server()
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        body = {"model": MODEL, "max_tokens": 4, "messages": HI}
        fake.fail_steps = 1
        assert_anthropic_error(c.post("/v1/messages", json=body), 500, "injected step failure")
        fake.fail_steps = 1
        events = sse_typed_events(c.post("/v1/messages", json={**body, "stream": True}).text)
        assert [n for n, _ in events] == ["message_start", "ping", "error"]
        assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": events[-1][1]["error"][
            "message"]}} and "injected step failure" in events[-1][1]["error"]["message"]


def test_disconnect_aborts_and_frees_blocks():
    srv, fake = scripted_server(step_s=0.01)
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        body = {"model": MODEL, "max_tokens": 400, "messages": HI, "stream": True}
        with c.stream("POST", "/v1/messages", json=body) as r:
            lines = r.iter_lines()
            assert sum(next(lines).startswith("data: ") for _ in range(12)) >= 3
            assert fake.used_blocks() > 0
        wait_until_free(fake, c)
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/messages", json={**body, "stream": False}, timeout=0.3)
        wait_until_free(fake, c)


THOUGHT = "<think>why</think>answer"


@pytest.fixture(scope="module")
def reasoning_client():
    srv, fake = scripted_server(reasoning_parser="qwen3")
    with srv, httpx.Client(base_url=srv.url, timeout=10, headers={"anthropic-version": "2023-06-01"}) as c:
        c.fake, c.url = fake, srv.url
        yield c


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}])
def test_thinking_block_before_the_text(reasoning_client, thinking):
    body = create(reasoning_client, reasoning_client.fake, THOUGHT, thinking=thinking)
    assert body["content"] == [{"type": "thinking", "thinking": "why", "signature": ""},
                               {"type": "text", "text": "answer"}]
    assert body["stop_reason"] == "end_turn" and body["usage"]["output_tokens"] == len(THOUGHT)


@pytest.mark.parametrize("thinking", [None, {"type": "disabled"}])
def test_reasoning_is_left_out_unless_thinking_is_on(reasoning_client, thinking):
    body = create(reasoning_client, reasoning_client.fake, THOUGHT, **({"thinking": thinking} if thinking else {}))
    assert body["content"] == [{"type": "text", "text": "answer"}]
    reasoning_client.fake.script = [THOUGHT]
    r = reasoning_client.post("/v1/messages", json={"model": MODEL, "max_tokens": 64, "messages": HI, "stream": True,
                                                    **({"thinking": thinking} if thinking else {})})
    starts = [d["content_block"] for n, d in sse_typed_events(r.text) if n == "content_block_start"]
    assert starts == [{"type": "text", "text": ""}]


def test_stream_thinking_events_then_text_events(reasoning_client):
    reasoning_client.fake.script = [THOUGHT]
    r = reasoning_client.post("/v1/messages", json={"model": MODEL, "max_tokens": 64, "messages": HI, "stream": True,
                                                    "thinking": {"type": "enabled", "budget_tokens": 1024}})
    events = sse_typed_events(r.text)
    assert [n for n, _ in events] == ["message_start", "ping", "content_block_start", *["content_block_delta"] * 3,
                                      "content_block_stop", "content_block_start", *["content_block_delta"] * 6,
                                      "content_block_stop", "message_delta", "message_stop"]
    assert events[2][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "thinking", "thinking": "", "signature": ""}}
    assert [d["delta"] for d in (e[1] for e in events[3:6])] == [
        {"type": "thinking_delta", "thinking": c} for c in "why"]
    assert events[6][1] == {"type": "content_block_stop", "index": 0}
    assert events[7][1]["content_block"] == {"type": "text", "text": ""} and events[7][1]["index"] == 1
    assert "".join(d["delta"]["text"] for _, d in events[8:14]) == "answer"
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"


def test_anthropic_sdk_parses_the_thinking_block(reasoning_client):
    client = anthropic.Anthropic(base_url=reasoning_client.url, api_key="x")
    reasoning_client.fake.script = [THOUGHT]
    msg = client.messages.create(model=MODEL, max_tokens=64, messages=HI,
                                 thinking={"type": "enabled", "budget_tokens": 1024})
    assert [type(b).__name__ for b in msg.content] == ["ThinkingBlock", "TextBlock"]
    assert (msg.content[0].thinking, msg.content[1].text) == ("why", "answer")
    reasoning_client.fake.script = [THOUGHT]
    with client.messages.stream(model=MODEL, max_tokens=64, messages=HI,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == "why"
