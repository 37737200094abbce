"""``/v1/responses`` against a scripted fake engine: each request field reaches the chat path (or is a 400 in
OpenAI's error shape), output items, usage, status, the streamed event sequence, the store and its routes,
cancel, engine failure and disconnect."""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx
import openai
import pytest

from api_fakes import MODEL, scripted_server, scripted_serving, sse_typed_events, wait_until_free
from pagedllm.entrypoints.openai.api_server import add_server_args, response_store_from_args
from pagedllm.entrypoints.openai.response_store import ResponseStore
from server_utils import assert_error

TOOLS = [{"type": "function", "name": "get_weather", "description": "weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def served():
    with scripted_serving() as srv:
        yield srv


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served.url, timeout=10) as c:
        yield c


def create(client, fake, script: str | None = None, **body) -> dict:
    if script is not None:
        fake.script = [script]
    r = client.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_text_response_items_usage_and_echoed_fields(served, client):
    fake = served.fake
    body = create(client, fake, "Hello.", input="hi", instructions="Be brief.", metadata={"k": "v"}, user="u1",
                  temperature=0.5, top_p=0.9)
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["status"] == "completed"
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "Hello.", "annotations": [], "logprobs": []}]
    prompt = fake.prompt_seen[-1]
    assert body["usage"] == {"input_tokens": len(prompt), "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": 6, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": len(prompt) + 6}
    assert fake.conversations[-1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (body["metadata"], body["user"], body["instructions"]) == ({"k": "v"}, "u1", "Be brief.")
    assert (fake.last_params.temperature, fake.last_params.top_p) == (0.5, 0.9)


def test_length_cut_is_incomplete_with_its_reason(served, client):
    body = create(client, served.fake, "a long answer", input="hi", max_output_tokens=3)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == "a l" and served.fake.last_params.max_tokens == 3


def test_stop_reaches_the_engine(served, client):
    body = create(client, served.fake, "one. two.", input="hi", stop=["."])
    assert body["output"][0]["content"][0]["text"] == "one" and body["status"] == "completed"


def test_input_items_become_the_conversation(served, client):
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
             {"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}]
    create(client, served.fake, "done", input=items)
    conv = served.fake.conversations[-1]
    assert [m["role"] for m in conv] == ["developer", "user", "assistant", "tool", "tool", "assistant"]
    assert [c["id"] for c in conv[2]["tool_calls"]] == ["c1", "c2"] and not conv[2].get("content")
    assert conv[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert conv[4]["content"] == "rain"  # text parts reach the template as one string


def test_required_tool_choice_gives_function_calls_valid_for_the_schema(served, client):
    fake = served.fake
    script = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    body = create(client, fake, script, input="weather?", tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False)
    (call,) = body["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"].startswith("call_")
    schema = fake.last_params.structured_outputs.json
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["parameters"] == TOOLS[0]["parameters"]
    assert fake.tools_seen[-1][0]["function"]["name"] == "get_weather"
    assert body["tools"] == TOOLS and body["parallel_tool_calls"] is False


def test_named_tool_choice_constrains_to_its_parameters(served, client):
    body = create(client, served.fake, '{"city": "Rome"}', input="weather?", tools=TOOLS,
                  tool_choice={"type": "function", "name": "get_weather"})
    assert [(o["type"], o["arguments"]) for o in body["output"]] == [("function_call", '{"city": "Rome"}')]
    assert served.fake.last_params.structured_outputs.json == TOOLS[0]["parameters"]


def test_tool_choice_none_sends_tools_but_no_constraint(served, client):
    body = create(client, served.fake, "plain", input="hi", tools=TOOLS, tool_choice="none")
    assert body["output"][0]["type"] == "message" and served.fake.last_params.structured_outputs is None


@pytest.mark.parametrize("fmt, expected", [
    ({"type": "json_schema", "name": "city", "schema": {"type": "object", "properties": {"n": {"type": "string"}}}},
     {"json": {"type": "object", "properties": {"n": {"type": "string"}}}}),
    ({"type": "json_object"}, {"json_object": True}),
    ({"type": "text"}, None)])
def test_text_format_is_a_structured_output(served, client, fmt, expected):
    body = create(client, served.fake, "{}", input="hi", text={"format": fmt})
    got = served.fake.last_params.structured_outputs
    assert (None if got is None else {k: v for k, v in vars(got).items() if v not in (None, False)}) == expected
    assert body["text"] == {"format": fmt}


def test_store_previous_response_id_get_and_delete(served, client):
    fake = served.fake
    first = create(client, fake, "It is sunny in Paris today.", input="weather in Paris?")
    assert client.get(f"/v1/responses/{first['id']}").json() == first
    second = create(client, fake, "Yes.", input="sure?", previous_response_id=first["id"])
    assert fake.conversations[-1][0]["role"] == "user"
    assert fake.conversations[-1] == [{"role": "user", "content": "weather in Paris?"},
                                      {"role": "assistant", "content": "It is sunny in Paris today."},
                                      {"role": "user", "content": "sure?"}]
    assert second["previous_response_id"] == first["id"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the prefix cache serves the history
    assert client.delete(f"/v1/responses/{first['id']}").json() == {"id": first["id"], "object": "response",
                                                                   "deleted": True}
    assert_error(client.get(f"/v1/responses/{first['id']}"), 404, "response_id")
    assert_error(client.delete(f"/v1/responses/{first['id']}"), 404, "response_id")
    assert_error(client.post("/v1/responses", json={"input": "x", "previous_response_id": first["id"]}), 404,
                 "previous_response_id")
    unstored = create(client, fake, "x", input="hi", store=False)
    assert unstored["store"] is False
    assert_error(client.get(f"/v1/responses/{unstored['id']}"), 404)


def test_store_is_bounded_by_count_and_bytes_least_recent_out():
    store = ResponseStore(max_count=2, max_bytes=100)
    resp = [type("R", (), {"id": f"r{i}"})() for i in range(4)]
    store.put(resp[0], [], 10)
    store.put(resp[1], [], 10)
    store.get("r0")  # r1 is now the least recently used
    store.put(resp[2], [], 10)
    assert store.get("r1") is None and store.get("r0") and store.get("r2") and store.num_bytes == 20
    store.put(resp[3], [], 95)  # over the count, then over the bytes: the oldest go until both hold
    assert len(store) == 1 and store.get("r3") and store.num_bytes == 95
    store.put(resp[0], [], 101)  # larger than the store: not kept
    assert store.get("r0") is None
    assert not ResponseStore(0, 0).is_enabled
    with pytest.raises(ValueError, match="limits"):
        ResponseStore(-1)


def test_store_flags():
    parser = add_server_args(argparse.ArgumentParser(), include_engine_args=False)
    store = response_store_from_args(parser.parse_args(["--response-store-max-count", "3",
                                                        "--response-store-max-bytes", "4096"]))
    assert (store.max_count, store.max_bytes, store.is_enabled) == (3, 4096, True)
    assert not response_store_from_args(parser.parse_args(["--disable-response-store"])).is_enabled
    with pytest.raises(ValueError, match="--response-store-max-count"):
        response_store_from_args(parser.parse_args(["--response-store-max-count", "0"]))


def test_store_off_refuses_previous_response_id():
    srv, fake = scripted_server(app_response_store=ResponseStore(0, 0))
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        body = create(c, fake, "x", input="hi")
        assert body["store"] is False
        err = assert_error(c.post("/v1/responses", json={"input": "x", "previous_response_id": body["id"]}), 400,
                           "previous_response_id")
        assert "store is off" in err["message"]


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "max_tool_calls": 3}, "max_tool_calls"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "prompt": {"id": "p"}}, "prompt"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c"}]}, "input"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"input": "hi", "tools": TOOLS}, "tool_choice"),  # auto needs a tool-call parser: the fake template has none
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10**6}, "input"),  # beyond the context
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "stream": "yes"}, "stream"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning"),
])
def test_fields_not_honoured_are_400_naming_them(client, body, param):
    assert_error(client.post("/v1/responses", json=body), 400, param)


@pytest.mark.parametrize("tool", [{"type": "function", "parameters": {}}, {"type": "function", "name": 5}])
def test_a_function_tool_without_a_name_is_400_in_responses_terms(client, tool):
    err = assert_error(client.post("/v1/responses", json={"input": "hi", "tools": [tool]}), 400, "tools")
    assert err["message"] == "tools[0].name is required (a string): a function tool needs a name"


def test_unknown_model_is_404(client):
    assert_error(client.post("/v1/responses", json={"model": "other", "input": "hi"}), 404, "model")


def test_accepted_fields_without_effect(served, client):
    body = create(client, served.fake, "x", input="hi", reasoning={"summary": "auto"}, prompt_cache_key="k",
                  include=["reasoning.encrypted_content"], truncation="disabled", background=False,
                  safety_identifier="s", service_tier="auto", stream_options=None)
    assert body["status"] == "completed" and [o["type"] for o in body["output"]] == ["message"]


@pytest.mark.parametrize("reasoning, variables", [({"effort": "high", "summary": "auto"}, {"reasoning_effort": "high"}),
                                                  ({"summary": "auto"}, {}), (None, {})])
def test_reasoning_effort_reaches_the_template_as_on_chat(served, client, reasoning, variables):
    create(client, served.fake, "x", input="hi", **({"reasoning": reasoning} if reasoning else {}))
    assert served.fake.template_kwargs_seen[-1] == variables


TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", *["response.output_text.delta"] * 3, "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]


def test_stream_text_event_sequence(served, client):
    served.fake.script = ["abc"]
    r = client.post("/v1/responses", json={"input": "hi", "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_typed_events(r.text)
    assert [name for name, _ in events] == TEXT_EVENTS == [data["type"] for _, data in events]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    created, item_added, part_added = events[0][1], events[2][1], events[3][1]
    assert created["response"]["status"] == "in_progress" and created["response"]["output"] == []
    item_id = item_added["item"]["id"]
    assert item_added["item"]["status"] == "in_progress" and item_added["item"]["content"] == []
    assert part_added["part"] == {"type": "output_text", "text": "", "annotations": []}
    assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == "abc"
    assert all(d["item_id"] == item_id for _, d in events[3:9])
    assert events[7][1]["text"] == "abc" and events[9][1]["item"]["status"] == "completed"
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "abc"
    assert final["usage"]["output_tokens"] == 3
    assert client.get(f"/v1/responses/{final['id']}").json()["output"] == final["output"]


def test_stream_function_call_events(served, client):
    served.fake.script = ['{"city": "Oslo"}']
    r = client.post("/v1/responses", json={"input": "hi", "stream": True, "tools": TOOLS,
                                           "tool_choice": {"type": "function", "name": "get_weather"}})
    events = sse_typed_events(r.text)
    names = [n for n, _ in events]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert names[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(names[3:-3]) == {"response.function_call_arguments.delta"}
    added = events[2][1]["item"]
    assert added["type"] == "function_call" and added["arguments"] == "" and added["name"] == "get_weather"
    deltas = "".join(d["delta"] for n, d in events if n == "response.function_call_arguments.delta")
    assert deltas == events[-3][1]["arguments"] == '{"city": "Oslo"}'
    assert events[-1][1]["response"]["output"][0]["call_id"] == added["call_id"]


def test_stream_length_cut_ends_incomplete(served, client):
    served.fake.script = ["abcdef"]
    r = client.post("/v1/responses", json={"input": "hi", "stream": True, "max_output_tokens": 2})
    last = sse_typed_events(r.text)[-1][1]
    assert last["type"] == "response.incomplete" and last["response"]["incomplete_details"]["reason"] == \
        "max_output_tokens"


def test_engine_failure_is_500_or_error_and_failed_events():
    srv, fake = scripted_server()
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        fake.fail_steps = 1
        err = assert_error(c.post("/v1/responses", json={"input": "hi"}), 500)
        assert "injected step failure" in err["message"]
        fake.fail_steps = 1
        events = sse_typed_events(c.post("/v1/responses", json={"input": "hi", "stream": True}).text)
        assert [n for n, _ in events] == ["response.created", "response.in_progress", "error", "response.failed"]
        assert events[2][1]["code"] == "500" and events[-1][1]["response"]["status"] == "failed"
        assert "injected step failure" in events[-1][1]["response"]["error"]["message"]
        assert [d["sequence_number"] for _, d in events] == [0, 1, 2, 3]


def test_disconnect_aborts_and_frees_blocks():
    srv, fake = scripted_server(step_s=0.01)
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        with c.stream("POST", "/v1/responses", json={"input": "abcdefgh", "stream": True}) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: ") for _ in range(8))
            assert fake.used_blocks() > 0
        wait_until_free(fake, c)
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/responses", json={"input": "abcdefgh"}, timeout=0.3)
        wait_until_free(fake, c)


def test_cancel_a_streaming_response_aborts_it():
    srv, fake = scripted_server(step_s=0.01)
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        with c.stream("POST", "/v1/responses", json={"input": "abcdefgh", "stream": True}) as r:
            lines = r.iter_lines()
            created = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            rid = created["response"]["id"]
            cancelled = c.post(f"/v1/responses/{rid}/cancel").json()
            assert cancelled["status"] == "cancelled" and cancelled["id"] == rid
            rest = [json.loads(line[6:])["type"] for line in lines if line.startswith("data: ")]
        assert "response.completed" not in rest
        wait_until_free(fake, c)
        assert_error(c.post(f"/v1/responses/{rid}/cancel"), 404, "response_id")
        done = create(c, fake, "x", input="hi")
        assert_error(c.post(f"/v1/responses/{done['id']}/cancel"), 400, "response_id")


def test_cancel_a_blocking_response_answers_cancelled():
    srv, fake = scripted_server(step_s=0.01)
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        result = {}
        t = threading.Thread(target=lambda: result.update(r=c.post("/v1/responses", json={"input": "abcdefgh"})))
        t.start()
        while not srv.server.config.app.state.responses._running:
            time.sleep(0.01)
        (rid,) = srv.server.config.app.state.responses._running
        assert c.post(f"/v1/responses/{rid}/cancel").status_code == 200
        t.join(5)
        assert result["r"].json()["status"] == "cancelled"
        wait_until_free(fake, c)


THOUGHT = "<think>why</think>answer"


@pytest.fixture(scope="module")
def reasoning_served():
    srv, fake = scripted_server(reasoning_parser="qwen3")
    with srv:
        srv.fake = fake
        yield srv


def test_reasoning_item_before_the_message_with_its_tokens(reasoning_served):
    with httpx.Client(base_url=reasoning_served.url, timeout=10) as c:
        body = create(c, reasoning_served.fake, THOUGHT, input="hi")
        rid = body["id"][5:]
        assert body["output"] == [
            {"type": "reasoning", "id": f"rs_{rid}_0", "summary": [], "status": "completed",
             "content": [{"type": "reasoning_text", "text": "why"}]},
            {"type": "message", "id": f"msg_{rid}_1", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "answer", "annotations": [], "logprobs": []}]}]
        assert body["usage"]["output_tokens"] == len(THOUGHT)
        assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": len("why")}
        # the reasoning item sent back is skipped; the continuation sees the answer only
        create(c, reasoning_served.fake, "ok", previous_response_id=body["id"],
               input=[body["output"][0], {"role": "user", "content": "more"}])
        assert reasoning_served.fake.conversations[-1] == [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "answer"},
            {"role": "user", "content": "more"}]


def test_a_length_cut_inside_reasoning_is_an_incomplete_reasoning_item(reasoning_served):
    with httpx.Client(base_url=reasoning_served.url, timeout=10) as c:
        body = create(c, reasoning_served.fake, THOUGHT, input="hi", max_output_tokens=9)
    assert body["status"] == "incomplete" and [o["type"] for o in body["output"]] == ["reasoning"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "wh"}]
    assert body["output"][0]["status"] == "incomplete"
    assert body["usage"]["output_tokens"] == body["usage"]["output_tokens_details"]["reasoning_tokens"] == 9


def test_stream_reasoning_events_then_text_events(reasoning_served):
    reasoning_served.fake.script = [THOUGHT]
    with httpx.Client(base_url=reasoning_served.url, timeout=10) as c:
        events = sse_typed_events(c.post("/v1/responses", json={"input": "hi", "stream": True}).text)
    assert [n for n, _ in events] == (
        ["response.created", "response.in_progress", "response.output_item.added",
         *["response.reasoning_text.delta"] * 3, "response.reasoning_text.done", "response.output_item.done"]
        + TEXT_EVENTS[2:4] + ["response.output_text.delta"] * 6 + TEXT_EVENTS[-4:])
    rs_id = events[2][1]["item"]["id"]
    assert events[2][1]["item"] == {"type": "reasoning", "id": rs_id, "summary": [], "content": [],
                                    "status": "in_progress"}
    assert [d["delta"] for n, d in events if n == "response.reasoning_text.delta"] == ["w", "h", "y"]
    assert all((d["item_id"], d["output_index"], d["content_index"]) == (rs_id, 0, 0) for _, d in events[3:7])
    assert events[6][1]["text"] == "why" and events[7][1]["output_index"] == 0
    assert events[7][1]["item"]["content"] == [{"type": "reasoning_text", "text": "why"}]
    assert events[7][1]["item"]["status"] == "completed" and events[8][1]["output_index"] == 1
    assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == "answer"
    final = events[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["id"] == rs_id and final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3


def test_openai_sdk_parses_the_reasoning_item(reasoning_served):
    client = openai.OpenAI(base_url=f"{reasoning_served.url}/v1", api_key="x")
    reasoning_served.fake.script = [THOUGHT]
    resp = client.responses.create(model=MODEL, input="hi")
    assert [type(o).__name__ for o in resp.output] == ["ResponseReasoningItem", "ResponseOutputMessage"]
    assert resp.output[0].content[0].text == "why" and resp.output_text == "answer"
    assert resp.usage.output_tokens_details.reasoning_tokens == 3
    reasoning_served.fake.script = [THOUGHT]
    with client.responses.stream(model=MODEL, input="hi") as stream:
        kinds = [type(e).__name__ for e in stream]
        final = stream.get_final_response()
    assert kinds.count("ResponseReasoningTextDeltaEvent") == 3 and "ResponseReasoningTextDoneEvent" in kinds
    assert [o.type for o in final.output] == ["reasoning", "message"]
