"""The HTTP server against the fake engine (fast): protocol shapes, SSE, the error contract,
auth, backpressure, disconnects, engine failure. Real uvicorn on a free 127.0.0.1 port.

The real-model tests (official openai client, greedy == LLM.generate, load) live in
tests/test_server_openai.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import socket
import threading
import time

import httpx
import pytest

from pagedllm.entrypoints.openai.api_server import add_server_args, resolve_api_key
from fake_engine import FakeEngine
from server_utils import MODEL, assert_error, make_server, sse_events

@pytest.fixture(scope="module")
def server():
    srv, fake = make_server(FakeEngine(max_model_len=64, max_logprobs=5))
    with srv:
        srv.fake = fake
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


# ---------------------------------------------------------------------------- completions
def test_completion_text_usage_and_finish(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, "abc", "length")]
    story = body["usage"].pop("metrics")
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # the request's story: nothing cached, never preempted, every phase timed
    assert story["num_preemptions"] == 0 and story["preemption_modes"] == []
    assert all(story[k] is not None and story[k] >= 0 for k in ("queue_time", "prefill_time", "decode_time"))


def test_usage_metrics_can_be_switched_off():
    fake = FakeEngine(max_model_len=64)
    fake.config = fake.config.replace(usage_metrics=False)
    srv, _ = make_server(fake)
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["metrics"] is None
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


@pytest.mark.parametrize("prompt, expected_prompt_tokens", [
    (["hi", "yo!"], 5), ([104, 105], 2), ([[104, 105], [120]], 3)])
def test_completion_prompt_forms_and_n(client, prompt, expected_prompt_tokens, server):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    num_prompts = len(prompt) if isinstance(prompt[0], (str, list)) else 1
    assert [c["index"] for c in body["choices"]] == list(range(2 * num_prompts))
    assert [c["text"] for c in body["choices"]] == ["ab", "bc"] * num_prompts
    assert body["usage"]["prompt_tokens"] == expected_prompt_tokens
    assert body["usage"]["completion_tokens"] == 4 * num_prompts


def test_completion_echo_with_prompt_logprobs(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "echo": True,
                                             "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "hiab"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["h", "i", "a", "b"]
    assert lp["token_logprobs"] == [None, -2.0, -0.25, -0.25]
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {"i": -2.0}
    assert lp["top_logprobs"][2] == {"a": -0.25, "Z": -1.5}


def test_completion_stream_protocol(client):
    body = {"model": MODEL, "prompt": ["hi", "yo"], "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}, "echo": True, "logprobs": 0}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    finishes: dict[int, list] = {}
    offsets: dict[int, list] = {}
    for ch in chunks[:-1]:
        assert ch["usage"] is None
        for c in ch["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            offsets.setdefault(c["index"], []).extend(c["logprobs"]["text_offset"])
            if c["finish_reason"] is not None:
                finishes.setdefault(c["index"], []).append(c["finish_reason"])
    assert texts == {0: "hiabc", 1: "hibcd", 2: "yoabc", 3: "yobcd"}
    assert finishes == {i: ["length"] for i in range(4)}
    assert offsets[0] == [0, 1, 2, 3, 4]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert chunks[-1]["usage"]["prompt_tokens"] == 4


# ---------------------------------------------------------------------------- chat
def test_chat_non_stream(client, server):
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "system", "content": "S"},
                                     {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_completion_tokens": 2, "max_tokens": 9, "logprobs": True, "top_logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "ab"}
    assert choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["a", "b"]
    assert content[0]["logprob"] == -0.25 and content[0]["bytes"] == [97]
    assert content[0]["top_logprobs"] == [{"token": "a", "logprob": -0.25, "bytes": [97]}]
    prompt = "[system]S[user]Hi[assistant]"
    assert server.fake.prompt_seen[-1] == [1] + [ord(c) for c in prompt]
    assert body["usage"]["prompt_tokens"] == 1 + len(prompt)


def test_chat_stream_role_first_and_one_finish_per_choice(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    first = chunks[0]["choices"]
    assert [(c["index"], c["delta"]["role"], c["delta"]["content"]) for c in first] == [
        (0, "assistant", ""), (1, "assistant", "")]
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for ch in chunks[1:-1]:
        for c in ch["choices"]:
            assert c["delta"]["role"] is None
            texts[c["index"]] += c["delta"]["content"] or ""
            if c["finish_reason"]:
                finishes[c["index"]].append(c["finish_reason"])
    assert texts == {0: "abc", 1: "bcd"} and finishes == {0: ["length"], 1: ["length"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_slow_chat_template_does_not_stall_a_running_stream():
    """A chat request whose rendering is slow (a huge conversation) is tokenized off the
    engine thread: a stream already running keeps receiving tokens meanwhile, then the chat
    request is answered."""
    fake = FakeEngine(step_s=0.002, max_model_len=4096)
    stuck, release = threading.Event(), threading.Event()
    srv, _ = make_server(fake)
    with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        chat: dict = {}

        def post_chat() -> None:
            msgs = [{"role": "user", "content": "huge " * 400}]
            chat["r"] = c.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 2})

        body = {"model": MODEL, "prompt": "a", "max_tokens": 3000, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            fake.tokenizer.on_encode = lambda text: "huge" in text and (stuck.set(), release.wait(30))
            poster = threading.Thread(target=post_chat)
            poster.start()
            assert stuck.wait(10)
            events = [line for line in itertools.islice(lines, 60) if line.startswith("data: ")]
            chat_done_while_stuck = "r" in chat
            release.set()
        poster.join(30)
    assert len(events) >= 25 and not chat_done_while_stuck  # 25+ tokens streamed while the template was stuck
    assert chat["r"].status_code == 200, chat["r"].text
    assert chat["r"].json()["usage"]["prompt_tokens"] > 2000


# ---------------------------------------------------------------------------- error contract (C27, C11, C29)
_BAD = [
    ("/v1/completions", {"model": "does-not-exist", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 100000}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": None},
                                                           {"role": "user", "content": "x"}]}, 400, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 100}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": [200]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 70, "max_tokens": 1}, 400, "prompt"),  # context length
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 40, "max_tokens": 30}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [""]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    # booleans are JSON booleans (OpenAI answers 400 to 0/1 and "true")
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "include_stop_str_in_output": 0}, 400,
     "include_stop_str_in_output"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": "true"}, 400, "echo"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": 1},
     400, "logprobs"),
    # output constraints and tools (structured outputs): refused before the engine sees them
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "a", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}},
     400, "response_format"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_regex": "(abc"}, 400, "guided_regex"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "structured_outputs": {"grammar": "root ::= nothing"}},
     400, "structured_outputs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]},
     400, "guided_choice"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"description": "no name"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body, status, param", _BAD)
def test_bad_input_gets_openai_error_then_service_continues(client, path, body, status, param, stream):
    r = client.post(path, json={**body, "stream": stream})
    err = assert_error(r, status, param)
    if status == 404:
        assert "does-not-exist" in err["message"] and MODEL in err["message"]
    ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200


def test_context_errors_give_the_numbers(client):
    err = assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 40, "max_tokens": 30}),
                       400)
    assert all(str(n) in err["message"] for n in (64, 40, 30, 70))


def test_malformed_json_and_wrong_types(client):
    r = client.post("/v1/completions", content=b'{"model": "fake-model", "prompt": ', headers={
        "content-type": "application/json"})
    err = assert_error(r, 400)
    assert "JSON" in err["message"]
    assert_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"}), 400, "messages")
    assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": 1}), 400, "stream")
    assert_error(client.post("/tokenize", json={"model": MODEL, "prompt": "hi", "add_special_tokens": 0}), 400,
                 "add_special_tokens")
    assert_error(client.get("/v1/nothing-here"), 404)


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "max_tokens", "2"), ("/v1/completions", "max_tokens", True),
    ("/v1/completions", "max_tokens", 2.5), ("/v1/completions", "n", "1"), ("/v1/completions", "logprobs", True),
    ("/v1/completions", "frequency_penalty", False), ("/v1/completions", "temperature", "0.5"),
    ("/v1/completions", "seed", "7"), ("/v1/completions", "top_k", True), ("/v1/completions", "priority", "1"),
    ("/v1/completions", "logit_bias", {"5": True}), ("/v1/chat/completions", "max_completion_tokens", "3"),
    ("/v1/chat/completions", "top_logprobs", True),
])
def test_numbers_are_json_numbers(client, path, field, value):
    """A string or a boolean for a numeric field is a 400 naming it, as OpenAI answers and the
    OpenAPI document says (was: coerced, `"max_tokens": "2"` ran 2 tokens)."""
    body = {"model": MODEL, "prompt": "hi"} if path == "/v1/completions" else {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    assert_error(client.post(path, json={**body, field: value}), 400, field)
    # a float field takes a JSON integer
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 1,
                                             "frequency_penalty": 0, "logit_bias": {"5": 1}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_max_tokens_null_runs_to_the_context_limit(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 54, "max_tokens": None})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 10
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_lone_surrogate_replaced_with_replacement_char(client, server):
    r = client.post("/v1/chat/completions", content=b'{"model": "fake-model", "max_tokens": 1, '
                    b'"messages": [{"role": "user", "content": "a\\ud800b"}]}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert server.fake.prompt_seen[-1][-len("[assistant]") - 3:-len("[assistant]")] == [ord("a"), ord("?"), ord("b")]
    r = client.post("/tokenize", content=b'{"prompt": "\\udfff"}', headers={"content-type": "application/json"})
    assert r.json()["tokens"] == [ord("?")]  # the fake tokenizer maps U+FFFD to "?"


# ---------------------------------------------------------------------------- small endpoints
def test_models_version_health_tokenize_detokenize(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 64 and models["data"][0]["tasks"] == ["generate"]
    assert client.get("/version").json()["version"]
    h = client.get("/health")
    assert h.status_code == 200 and h.content == b""
    tok = client.post("/tokenize", json={"prompt": "hey"}).json()
    assert tok == {"tokens": [104, 101, 121], "count": 3, "max_model_len": 64}
    chat_tok = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat_tok["tokens"][0] == 1 and chat_tok["count"] == len("[user]Hi[assistant]") + 1
    assert client.post("/detokenize", json={"tokens": [104, 105, 0]}).json() == {"prompt": "hi<eos>"}
    assert_error(client.post("/detokenize", json={"tokens": [999]}), 400, "tokens")
    assert_error(client.post("/tokenize", json={}), 400, "prompt")


def test_metrics_endpoint_names(client):
    client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    text = client.get("/metrics").text
    for name in ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc",
                 "pagedllm:prefix_cache_queries_total", "pagedllm:prefix_cache_hits_total",
                 "pagedllm:prompt_tokens_total", "pagedllm:generation_tokens_total",
                 "pagedllm:request_success_total", "pagedllm:time_to_first_token_seconds_bucket",
                 "pagedllm:inter_token_latency_seconds_bucket", "pagedllm:e2e_request_latency_seconds_bucket",
                 "pagedllm:request_queue_time_seconds_bucket", "pagedllm:num_preemptions_total"):
        assert name in text, name
    m = re.search(r'pagedllm:request_success_total\{engine="0",finished_reason="length",model_name="fake-model"\} (\S+)', text)
    assert m and float(m.group(1)) >= 1


# ---------------------------------------------------------------------------- auth
def test_api_key_required_when_configured(monkeypatch):
    srv, _ = make_server(api_key="sekret")
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        assert_error(c.post("/v1/completions", json=body), 401)
        assert_error(c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
        assert_error(c.post("/v1/completions", content=b"{bad", headers={"Authorization": "Bearer nope"}), 401)
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200
        for scheme in ("bearer", "BEARER", "BeArEr"):  # the scheme is case-insensitive, the key is not
            r = c.post("/v1/completions", json=body, headers={"Authorization": f"{scheme} sekret"})
            assert r.status_code == 200
        assert_error(c.post("/v1/completions", json=body, headers={"Authorization": "Bearer SEKRET"}), 401)
        assert c.post("/v1/completions", json=body).headers["www-authenticate"] == "Bearer"
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    parser = add_server_args(argparse.ArgumentParser())
    args = parser.parse_args(["m.gguf", "--port", "0", "--served-model-name", "a", "b", "--num-kv-blocks", "8",
                              "--max-waiting-requests", "3", "--no-enable-prefix-caching"])
    assert (args.model, args.served_model_name, args.num_kv_blocks, args.max_waiting_requests,
            args.enable_prefix_caching) == ("m.gguf", ["a", "b"], 8, 3, False)
    # --model as generate and chat take it; two different models are refused by name
    from pagedllm.entrypoints.openai.api_server import resolve_model_arg

    assert resolve_model_arg(parser.parse_args(["--model", "x.gguf"])) == "x.gguf"
    assert resolve_model_arg(parser.parse_args(["-m", "x.gguf", "x.gguf"])) == "x.gguf"
    assert resolve_model_arg(parser.parse_args(["y.gguf"])) == "y.gguf"
    with pytest.raises(ValueError, match="two models given"):
        resolve_model_arg(parser.parse_args(["y.gguf", "--model", "x.gguf"]))
    monkeypatch.setenv("PAGEDLLM_API_KEY", "from-env")
    assert resolve_api_key(parser.parse_args([])) == ["from-env"]
    assert resolve_api_key(parser.parse_args(["--api-key", "flag"])) == ["flag"]
    assert resolve_api_key(parser.parse_args(["--api-key", "k1", "k2"])) == ["k1", "k2"]


def test_chat_template_override_reaches_the_engine():
    srv, fake = make_server(chat_template="{{ messages }}")
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                                 "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200 and fake.last_chat_template == "{{ messages }}"


# ---------------------------------------------------------------------------- load shedding and failures
def test_backpressure_503_beyond_max_waiting_requests():
    srv, fake = make_server(FakeEngine(max_num_seqs=1, max_waiting_requests=1, step_s=0.01, max_model_len=512))
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        results = {}

        def long_request(i):
            results[i] = c.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 150})

        threads = [threading.Thread(target=long_request, args=(i,)) for i in range(2)]
        for i, t in enumerate(threads):
            t.start()
            deadline = time.monotonic() + 10  # the engine holds it (one running, then one waiting), however loaded
            while len(fake.requests) < i + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
        assert len(fake.requests) == 2
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
        err = assert_error(r, 503)
        assert "max_waiting_requests" in err["message"] and int(r.headers["retry-after"]) > 0
        for t in threads:
            t.join()
        assert [results[i].status_code for i in range(2)] == [200, 200]
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1}).status_code == 200


def test_client_disconnect_aborts_and_frees_blocks():
    srv, fake = make_server(FakeEngine(step_s=0.01, max_model_len=512))
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        body = {"model": MODEL, "prompt": "abcdefgh", "max_tokens": 400, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert fake.used_blocks() > 0
        t0 = time.monotonic()
        while fake.requests and time.monotonic() - t0 < 1.0:
            time.sleep(0.01)
        assert not fake.requests and fake.used_blocks() == 0
        time.sleep(0.1)
        text = c.get("/metrics").text
        assert 'pagedllm:kv_cache_usage_perc{engine="0",model_name="fake-model"} 0.0' in text
        assert 'pagedllm:request_success_total{engine="0",finished_reason="abort",model_name="fake-model"} 1.0' in text


def test_non_streaming_client_gone_aborts_too():
    srv, fake = make_server(FakeEngine(step_s=0.01, max_model_len=512))
    with srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 400},
                       timeout=0.3)
        assert fake.requests
        t0 = time.monotonic()
        while fake.requests and time.monotonic() - t0 < 2.0:
            time.sleep(0.01)
        assert not fake.requests and fake.used_blocks() == 0


def test_step_failure_is_a_500_for_that_request_only():
    srv, fake = make_server()
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        fake.fail_steps = 1
        err = assert_error(c.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}), 500)
        assert "injected step failure" in err["message"]
        assert c.get("/health").status_code == 200  # the probe succeeds: the failure was transient
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}).status_code == 200
        fake.fail_steps = 10**9  # permanent fault
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "a", "stream": True}) as r:
            events = sse_events(r.read().decode())
        assert json.loads(events[0])["error"]["code"] == 500 and events[-1] == "[DONE]"
        t0 = time.monotonic()
        assert_error(c.get("/health"), 503)
        assert time.monotonic() - t0 < 1.0


def test_engine_death_health_503_and_prompt_errors():
    srv, fake = make_server(FakeEngine(step_s=0.01, max_model_len=512))
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        assert c.get("/health").status_code == 200
        fake.die = True
        t0 = time.monotonic()
        assert_error(c.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}), 503)
        assert_error(c.get("/health"), 503)
        assert_error(c.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": "x"}]}), 503)
        assert time.monotonic() - t0 < 1.0


def _first_event(response) -> str:
    return next(line for line in response.iter_lines() if line.startswith("data: "))


def test_client_request_id_is_a_label_retry_and_lookalikes_served():
    """A retry of a just-abandoned id is served; ids like a running request's child (``0_x``,
    ``x`` with n=2) or batch (``y-1``, ``y`` with two prompts) ids are served too."""
    srv, fake = make_server(FakeEngine(step_s=0.005, max_model_len=512))
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "min_tokens": 200, "stream": True,
                "request_id": "retry-1"}
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) == 3
        again = c.post("/v1/completions", json={**body, "stream": False, "max_tokens": 3, "min_tokens": 0})
        assert again.status_code == 200 and again.json()["id"] == "retry-1"
        assert again.json()["choices"][0]["text"] == "abc"
        long = {"model": MODEL, "max_tokens": 300, "stream": True}
        with c.stream("POST", "/v1/completions", json={**long, "prompt": "a", "n": 2, "request_id": "x"}) as rx, \
                c.stream("POST", "/v1/completions", json={**long, "prompt": ["a", "b"], "request_id": "y"}) as ry:
            assert _first_event(rx) and _first_event(ry)
            for rid in ("0_x", "1_x", "x", "y-0", "y-1", "y"):
                r = c.post("/v1/completions", json={"model": MODEL, "prompt": "q", "max_tokens": 2, "request_id": rid})
                assert r.status_code == 200 and r.json()["id"] == rid and r.json()["choices"][0]["text"] == "ab"
            chat = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "request_id": "x",
                                                        "messages": [{"role": "user", "content": "q"}]})
            assert chat.status_code == 200 and chat.json()["id"] == "x"


# ---------------------------------------------------------------------------- the server as clients found it
def test_multi_prompt_request_disconnect_aborts_every_prompt_and_prompt_limit():
    srv, fake = make_server(FakeEngine(step_s=0.01, max_model_len=512, max_num_seqs=4), max_prompts_per_request=40)
    with srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": ["a"] * 40, "max_tokens": 300},
                       timeout=2.0)  # the prompts are admitted well within it; generation takes ~30 s
        assert fake.requests
        t0 = time.monotonic()
        while fake.requests and time.monotonic() - t0 < 3.0:
            time.sleep(0.01)
        assert not fake.requests and fake.used_blocks() == 0
        err = assert_error(httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": ["a"] * 41}),
                           400, "prompt")
        assert "41" in err["message"] and "40" in err["message"]


def test_prompts_of_one_request_are_admitted_together(server, client):
    before = len(server.fake.added_at_step)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"] * 16, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 32
    assert len(set(server.fake.added_at_step[before:])) == 1  # no engine step between two of them


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(client):
    body = {"model": MODEL, "prompt": ["hi", "yo"], "max_tokens": 0, "echo": True, "logprobs": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == ["hi", "yo"] and {c["finish_reason"] for c in choices} == {"length"}
    assert choices[0]["logprobs"]["tokens"] == ["h", "i"]
    assert choices[0]["logprobs"]["token_logprobs"] == [None, -2.0]
    assert r.json()["usage"]["completion_tokens"] == 0
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = sse_events(s.read().decode())
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == 1) == "yo"
    assert_error(client.post("/v1/completions", json={**body, "echo": False}), 400, "max_tokens")


def test_sigterm_drains_then_ends_streams_in_band(caplog):
    srv, fake = make_server(FakeEngine(step_s=0.01, max_model_len=2048), drain_timeout_s=0.5)
    results: dict[str, list[str]] = {}

    def stream(name: str, max_tokens: int) -> None:
        body = {"model": MODEL, "prompt": "a", "max_tokens": max_tokens, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=10) as r:
            results[name] = sse_events(r.read().decode())

    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        threads = [threading.Thread(target=stream, args=(f"long{i}", 2000)) for i in range(2)]
        threads.append(threading.Thread(target=stream, args=("short", 20)))
        for t in threads:
            t.start()
        # all three added (the short one may already be done on a loaded machine: it was an endless wait)
        deadline = time.monotonic() + 30
        while len(fake.prompt_seen) < 3:
            assert time.monotonic() < deadline, "the three streams never reached the engine"
            time.sleep(0.01)
        srv.server.handle_exit(15, None)  # what SIGTERM does
        err = assert_error(c.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1}), 503)
        assert "shutting down" in err["message"]
        r = c.get("/health")
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
        for t in threads:
            t.join(10)
        srv.thread.join(10)
        assert not srv.thread.is_alive()
    assert results["short"][-1] == "[DONE]" and "error" not in results["short"][-2]
    for name in ("long0", "long1"):
        *body, error, done = results[name]
        assert done == "[DONE]" and json.loads(error)["error"]["code"] == 503, results[name][-3:]
        assert "shutting down" in json.loads(error)["error"]["message"] and body
    assert not [r for r in caplog.records if r.exc_info]


_SERVE_FAKE = """
import sys
sys.path.insert(0, {tests!r})
from fake_engine import FakeEngine
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import build_app, serve_app
engine = AsyncLLMEngine(FakeEngine(step_s=0.01, max_model_len=4096), stats_log_interval_s=0)
serve_app(build_app(engine, ["fake-model"]), "127.0.0.1", {port}, "info", drain_timeout_s=0.3)
"""


def test_sigint_in_a_real_process_ends_streams_without_tracebacks(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    script = _SERVE_FAKE.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), port=port)
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # not up yet: refused, timed out or not yet healthy; each retries until the deadline
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "server never became healthy"
            time.sleep(0.1)
        results = []
        started = threading.Semaphore(0)

        def stream() -> None:
            body = {"model": MODEL, "prompt": "a", "max_tokens": 4000, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=20) as r:
                chunks = r.iter_text()
                first = next(chunks)
                started.release()
                results.append(sse_events(first + "".join(chunks)))

        threads = [threading.Thread(target=stream) for _ in range(4)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=20)
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(20)
        _, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert len(results) == 4, stderr[-3000:]
    for events in results:
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503
    assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr[-3000:]
    assert proc.returncode == 0


def test_wrong_method_is_405_with_allow(client):
    r = client.get("/v1/completions")
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"


# ---------------------------------------------------------------------------- the request contract
_USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/chat/completions", {"messages": _USER, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix"),
    ("/v1/completions", {"prompt": "a", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "a", "length_penalty": 0.5}, "length_penalty"),
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"messages": _USER, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "a", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"500": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [500]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "a", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("/v1/chat/completions", {"messages": _USER, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": _USER, "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": _USER, "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": _USER, "store": True}, "store"),
    ("/v1/chat/completions", {"messages": _USER, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"messages": _USER, "modalities": []}, "modalities"),
    ("/v1/chat/completions", {"messages": _USER, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": _USER, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": _USER, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/tokenize", {"messages": _USER, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": _USER, "use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"messages": _USER, "best_of": 2}, "best_of"),
    ("/v1/chat/completions", {"messages": _USER, "length_penalty": 0.5}, "length_penalty"),
    ("/v1/chat/completions", {"messages": _USER, "documents": [{"text": "d"}]}, "documents"),
    ("/v1/chat/completions", {"messages": _USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/tokenize", {"messages": _USER, "continue_final_message": True}, "continue_final_message"),
])
def test_fields_that_cannot_be_honoured_are_refused_by_name(client, path, body, param):
    assert_error(client.post(path, json={"model": MODEL, **body}), 400, param)


def test_off_values_of_unsupported_fields_and_user_are_accepted(client):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1, "suffix": "", "use_beam_search": False,
            "length_penalty": 1.0, "best_of": 1, "user": "u-1", "response_format": {"type": "text"}}
    assert client.post("/v1/completions", json=body).status_code == 200
    chat = {"model": MODEL, "messages": _USER, "max_tokens": 1, "echo": False, "store": False,
            "modalities": ["text"], "tool_choice": "none", "parallel_tool_calls": True, "user": "u-1"}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


def test_unknown_fields_are_ignored_and_logged_once_per_name(client, caplog):
    caplog.set_level("WARNING", logger="pagedllm.server")
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1, "frobnicate_7": 1}
    for _ in range(2):
        assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": _USER, "max_tokens": 1,
                                                     "frobnicate_7": 2}).status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "frobnicate_7" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("ignoring unknown request field")


def test_prompt_logprobs_in_completions_and_chat(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["prompt_logprobs"]
    assert lps == [None, {str(ord("i")): {"logprob": -2.0, "rank": 1, "decoded_token": "i"}}]
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}
                       ).json()["choices"][0]["prompt_logprobs"] is None
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": _USER, "max_tokens": 1,
                                                     "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_continue_final_message_reaches_the_template(server, client):
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one,"}]
    body = {"model": MODEL, "messages": msgs, "add_generation_prompt": False, "continue_final_message": True,
            "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert server.fake.last_continue_final_message is True
    assert client.post("/tokenize", json=body).status_code == 200
    assert server.fake.last_continue_final_message is True
    assert client.post("/v1/chat/completions", json={**body, "continue_final_message": False}).status_code == 200
    assert server.fake.last_continue_final_message is False


_SAMPLING_FIELDS = {"n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 11,
                    "presence_penalty": 0.3, "frequency_penalty": -0.4, "repetition_penalty": 1.2,
                    "stop": ["zz"], "stop_token_ids": [5], "bad_words": ["qq"], "include_stop_str_in_output": True,
                    "ignore_eos": True, "min_tokens": 1, "logit_bias": {"7": 2.5}, "allowed_token_ids": [97, 98, 99],
                    "skip_special_tokens": False, "spaces_between_special_tokens": False}


@pytest.mark.parametrize("path, extra", [("/v1/completions", {"prompt": "a", "logprobs": 2, "prompt_logprobs": 1}),
                                         ("/v1/chat/completions", {"messages": _USER, "logprobs": True,
                                                                   "top_logprobs": 2, "prompt_logprobs": 1})])
def test_every_sampling_field_reaches_the_engine(server, client, path, extra):
    body = {"model": MODEL, "max_tokens": 3, "priority": 4, **_SAMPLING_FIELDS, **extra}
    assert client.post(path, json=body).status_code == 200
    params = server.fake.last_params
    got = {name: getattr(params, name) for name in _SAMPLING_FIELDS}
    assert got == {**_SAMPLING_FIELDS, "logit_bias": {7: 2.5}}
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs, server.fake.last_priority) == (3, 2, 1, 4)


def test_token_ids_as_logprob_tokens_special_tokens_and_request_chat_template(server, client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 0,
                                             "return_tokens_as_token_ids": True, "add_special_tokens": False})
    assert r.json()["choices"][0]["logprobs"]["tokens"] == ["token_id:97", "token_id:98"]
    body = {"model": MODEL, "messages": _USER, "max_tokens": 1, "chat_template": "{{ custom }}"}
    refused = client.post("/v1/chat/completions", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    config = server.fake.config
    server.fake.config = config.replace(trust_request_chat_template=True)
    try:
        r = client.post("/v1/chat/completions", json=body)
    finally:
        server.fake.config = config
    assert r.status_code == 200 and server.fake.last_chat_template == "{{ custom }}"


def test_switch_interval_option_sets_the_interpreter_and_is_validated():
    import sys

    from pagedllm.entrypoints.openai.api_server import DEFAULT_SWITCH_INTERVAL_MS, set_switch_interval

    parser = argparse.ArgumentParser()
    add_server_args(parser, include_engine_args=False)
    assert parser.parse_args([]).switch_interval_ms == DEFAULT_SWITCH_INTERVAL_MS
    assert parser.parse_args(["--switch-interval-ms", "2.5"]).switch_interval_ms == 2.5
    before = sys.getswitchinterval()
    try:
        set_switch_interval(2.5)
        assert sys.getswitchinterval() == pytest.approx(0.0025)
        for bad in (0, -1, 5000):
            with pytest.raises(ValueError, match="--switch-interval-ms"):
                set_switch_interval(bad)
    finally:
        sys.setswitchinterval(before)


def test_retrieve_model_by_name(client):
    """OpenAI's GET /v1/models/{model} (the SDK's ``client.models.retrieve``): the served
    model's card, or 404 naming ``model`` (was a bare 404 for every name)."""
    card = client.get(f"/v1/models/{MODEL}").json()
    listed = client.get("/v1/models").json()["data"][0]
    assert {**card, "created": 0} == {**listed, "created": 0}  # `created` is the time of the answer
    assert card["id"] == MODEL and card["object"] == "model"
    error = assert_error(client.get("/v1/models/org/other-model"), 404, "model")
    assert "`org/other-model` does not exist" in error["message"] and MODEL in error["message"]


def test_a_bad_query_parameter_is_named(client):
    """A query parameter of the wrong type is a 400 naming it (was: param "query")."""
    error = assert_error(client.get("/kv/state?engine=abc"), 400, "engine")
    assert error["message"].startswith("engine: ")


@pytest.mark.parametrize("path, body, message", [
    # a union's failing members are not named: the path is the request's own
    ("/v1/completions", {"model": MODEL, "prompt": 123}, "prompt: Input should be a valid string, got 123"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt: List should have at least 1 item"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
     "messages.0.content: Input should be a valid string, got 5"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages.0.content.0.type: "),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias.abc: String should"),
])
def test_validation_messages_name_the_request_path(server, path, body, message):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        err = assert_error(c.post(path, json=body), 400)
    assert err["message"].startswith(message), err
    assert not re.search(r"constrained|\[key\]|list\[|\.str\b", err["message"]), err
