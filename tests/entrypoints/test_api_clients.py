"""The real clients of the Responses and Messages APIs against ``pagedllm serve`` with the default model
(SmolLM2): the openai SDK (``responses.create``, streaming, ``responses.parse``, function-tool loops), the
openai-agents SDK's default model class, langchain-openai with ``use_responses_api=True`` and the anthropic
SDK (``messages.create``, ``messages.stream``, a tool loop, ``count_tokens``). Greedy answers equal chat
completions' on the same conversation (the same engine path); disconnects free the blocks."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the openai SDK is not installed (pip install -e .[dev])")
anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is not installed (pip install -e .[dev])")

pytestmark = pytest.mark.slow

KEY = "test-key"
MODEL = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[2]
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather of a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ANTHROPIC_TOOLS = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
                   for t in TOOLS]
QUESTION = "What is the weather in Paris?"
GREEDY = {"temperature": 0}  # the anthropic SDK no longer takes temperature; clients send it as an extra


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(smollm2_path):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port), "--api-key", KEY,
           "--tool-call-parser", "hermes", "--stats-log-interval", "0", "--disable-log-requests"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail(f"pagedllm serve did not start: {proc.stderr.read()[-2000:]}")
    yield url
    proc.terminate()
    proc.wait(60)


@pytest.fixture(scope="module")
def oai(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server_url):
    return anthropic.Anthropic(base_url=server_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server_url):
    with httpx.Client(base_url=server_url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def chat_answer(oai, messages, max_tokens: int):
    """Chat completions' greedy ``(text, finish_reason, completion_tokens)``: the reference."""
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens


def chat_text(oai, messages, max_tokens: int) -> str:
    return chat_answer(oai, messages, max_tokens)[0]


def metric(text: str, name: str) -> float:
    m = re.search(rf"^pagedllm:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_responses_create_equals_chat_and_counts_the_prompt(oai, http):
    r = oai.responses.create(model=MODEL, instructions="Be brief.", input="Name a color.", max_output_tokens=12,
                             temperature=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    text, finish_reason, num_output = chat_answer(oai, messages, 12)
    assert r.output_text == text and text
    tokens = http.post("/tokenize", json={"messages": messages}).json()["count"]
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (tokens, num_output,
                                                                                  tokens + num_output)
    assert r.status == ("incomplete" if finish_reason == "length" else "completed")


def test_responses_stream_events_and_text(oai):
    kw = dict(model=MODEL, input="Count to five.", max_output_tokens=16, temperature=0)
    events = list(oai.responses.create(**kw, stream=True))
    final = events[-1].response
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if final.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == oai.responses.create(**kw).output_text
    with oai.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=300, temperature=0) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == \
            stream.get_final_response().output_text  # the helper needs response.completed: a full answer


def test_responses_parse_with_a_pydantic_model(oai):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        population: int

    r = oai.responses.parse(model=MODEL, input="Give me a city and its population as JSON.", text_format=City,
                            max_output_tokens=80, temperature=0)
    assert isinstance(r.output_parsed, City)


def test_function_tool_loop_with_output_items_and_previous_response_id(oai):
    first = oai.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, tool_choice="required",
                                 max_output_tokens=60, temperature=0)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and isinstance(__import__("json").loads(call.arguments)["city"], str)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}
    by_items = oai.responses.create(model=MODEL, input=[{"role": "user", "content": QUESTION}, call.model_dump(),
                                                        result], tools=TOOLS, max_output_tokens=20, temperature=0)
    by_id = oai.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=TOOLS,
                                 max_output_tokens=20, temperature=0)
    assert by_id.output_text == by_items.output_text and by_id.output_text
    assert by_id.usage.input_tokens_details.cached_tokens > 0
    assert by_id.usage.input_tokens == by_items.usage.input_tokens
    assert oai.responses.retrieve(first.id).output[0].call_id == call.call_id
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)


def test_openai_agents_default_model_with_a_function_tool(server_url):
    agents = pytest.importorskip("agents", reason="openai-agents is not installed (pip install -e .[dev])")
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=server_url + "/v1", api_key=KEY, max_retries=0),
                                     use_for_tracing=False)
    cities = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        cities.append(city)
        return "Sunny, 21 C."

    agent = agents.Agent(name="weather", instructions="Answer with the tool.", model=MODEL, tools=[get_weather],
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=40, temperature=0))
    result = asyncio.run(agents.Runner.run(agent, QUESTION, max_turns=4))
    assert len(cities) == 1 and isinstance(result.final_output, str) and result.final_output
    assert any(type(item).__name__ == "ToolCallOutputItem" for item in result.new_items)


def test_langchain_with_the_responses_api(server_url, oai):
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (pip install -e .[dev])")
    llm = lc.ChatOpenAI(model=MODEL, base_url=server_url + "/v1", api_key=KEY, use_responses_api=True,
                        max_tokens=12, temperature=0)
    message = llm.invoke("Name a color.")
    assert message.text == chat_text(oai, [{"role": "user", "content": "Name a color."}], 12)
    assert message.usage_metadata["output_tokens"] == chat_answer(oai, [{"role": "user", "content": "Name a color."}],
                                                                  12)[2]
    assert "".join(chunk.text for chunk in llm.stream("Name a color.")) == message.text


def test_anthropic_create_equals_chat_with_usage(claude, oai, http):
    m = claude.messages.create(model=MODEL, max_tokens=12, system="Be brief.", extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Name a color."}])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    text, finish_reason, num_output = chat_answer(oai, messages, 12)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text
    assert m.stop_reason == ("max_tokens" if finish_reason == "length" else "end_turn")
    assert m.usage.output_tokens == num_output
    tokens = http.post("/tokenize", json={"messages": messages}).json()["count"]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == tokens
    count = claude.messages.count_tokens(model=MODEL, system="Be brief.",
                                         messages=[{"role": "user", "content": "Name a color."}])
    assert count.input_tokens == tokens


def test_anthropic_stream(claude):
    kw = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=[{"role": "user", "content": "Count to five."}])
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == claude.messages.create(**kw).content[0].text
    assert final.stop_reason in ("max_tokens", "end_turn") and 0 < final.usage.output_tokens <= 16


def test_anthropic_tool_use_then_tool_result(claude):
    question = [{"role": "user", "content": QUESTION}]
    first = claude.messages.create(model=MODEL, max_tokens=60, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                                   messages=question, extra_body=GREEDY)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
    follow = question + [{"role": "assistant", "content": first.content},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": "Sunny, 21 C."}]}]
    second = claude.messages.create(model=MODEL, max_tokens=20, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"},
                                    messages=follow, extra_body=GREEDY)
    assert second.content[0].type == "text" and second.content[0].text
    assert second.usage.cache_read_input_tokens > 0
    with claude.messages.stream(model=MODEL, max_tokens=60, tools=ANTHROPIC_TOOLS, messages=question, extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and isinstance(streamed.content[0].input, dict)


def test_anthropic_errors_are_its_shape(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert e.value.body["type"] == "error" and "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=str(claude.base_url), api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"input": "Tell me a long story.", "max_output_tokens": 400, "stream": True}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
                      "stream": True})])
def test_disconnect_mid_stream_frees_blocks(http, path, body):
    used_before = metric(http.get("/metrics").text, "num_kv_blocks_used")
    with http.stream("POST", path, json={"model": MODEL, **body}) as r:
        lines = r.iter_lines()
        got = 0
        while got < 8:
            got += next(lines).startswith("data: ")
        assert metric(http.get("/metrics").text, "num_requests_running") == 1
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30.0:  # the engine's next step sees the abort (bounded wait, not a speed test)
        text = http.get("/metrics").text
        if metric(text, "num_kv_blocks_used") == used_before and metric(text, "num_requests_running") == 0:
            break
        time.sleep(0.05)
    assert metric(text, "num_kv_blocks_used") == used_before and metric(text, "num_requests_running") == 0
