"""The server with the real default model (SmolLM2-135M-Instruct), driven by the official
``openai`` client and raw HTTP: the issue's "Done when" list and cases C07, C11, C17, C20,
C25, C27, C29, C30.

One module-scoped server: the model is loaded once as ``LLM(...)``; the offline
references (``LLM.generate`` / ``LLM.chat``, greedy) are computed first, then the same
engine is served on a free 127.0.0.1 port by uvicorn in a background thread.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time

import httpx
import openai
import pytest

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.metrics import EngineMetrics
from pagedllm.sampling_params import SamplingParams
from server_utils import ServerThread, assert_error, sse_events

MODEL = "smollm2-135m-instruct"
API_KEY = "test-key"
MAX_MODEL_LEN = 256
PROMPTS = ["The capital of France is", "Once upon a time, there was a little"]
CHAT = [{"role": "user", "content": "What is 2+2? Answer briefly."}]
MAX_TOKENS = 12
CONTINUE = [{"role": "user", "content": "Count from one to ten in words."},
            {"role": "assistant", "content": "one, two, three,"}]
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def served(smollm2_path):
    from pagedllm import LLM

    llm = LLM(model=str(smollm2_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=256, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    refs = {
        "completions": llm.generate(PROMPTS, greedy, use_tqdm=False),
        "chat": llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)[0],
        "continue": llm.chat(CONTINUE, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False,
                             add_generation_prompt=False, continue_final_message=True)[0],
        "prompt_logprobs": llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                                        use_tqdm=False)[0],
    }
    engine = AsyncLLMEngine(llm.llm_engine, metrics=EngineMetrics(MODEL), stats_log_interval_s=0)
    with ServerThread(build_app(engine, [MODEL], api_key=API_KEY)) as srv:
        srv.llm, srv.refs, srv.engine = llm, refs, engine
        yield srv


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def metric(text: str, name: str) -> float:
    m = re.search(rf"^pagedllm:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


# ---------------------------------------------------------------------------- completions
def test_completions_greedy_equal_offline_generate_with_usage(client, served):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    refs = served.refs["completions"]
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in refs]
    assert [c.finish_reason for c in resp.choices] == [r.outputs[0].finish_reason for r in refs]
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert resp.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in refs)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens == 0  # prompts shorter than one block


def test_usage_cached_tokens_from_prefix_cache(client):
    long_prompt = "In a quiet village by the sea, " * 8  # ~70 tokens: 4 full blocks of 16
    first = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1, temperature=0)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every full block except one holding the last prompt token (recomputed for its logits)
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    # usage.metrics tells where they came from (the pool here: no offload tiers)
    assert first.usage.metrics["cached_tokens_by_tier"] == {"pool": 0, "host": 0, "disk": 0}
    assert again.usage.metrics["cached_tokens_by_tier"] == {"pool": (n - 1) // 16 * 16, "host": 0, "disk": 0}
    assert again.usage.metrics["num_preemptions"] == 0


def test_completions_stream_concatenates_to_non_stream(client, served, http):
    ref = served.refs["completions"][0].outputs[0]
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == ref.text and finishes == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    raw = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "stream": True})
    assert sse_events(raw.text)[-1] == "[DONE]" and raw.text.endswith("data: [DONE]\n\n")


def test_completions_stop_string(client, served):
    ref = served.refs["completions"][1].outputs[0].text
    words = ref.split()
    stop = " " + words[len(words) // 2]
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    choice = resp.choices[0]
    assert choice.text == ref[:ref.index(stop)] and choice.finish_reason == "stop"


def test_completions_n2_seeded_reproducible_and_distinct(client):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=1.0, n=2, seed=123)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    assert a.usage.completion_tokens == 20


def test_n4_stream_each_choice_to_its_own_finish(client):  # C17
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=4, seed=123)
    full = client.completions.create(**kw)
    texts, finishes = {i: "" for i in range(4)}, {i: [] for i in range(4)}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert [texts[i] for i in range(4)] == [c.text for c in full.choices]
    assert all(len(finishes[i]) == 1 for i in range(4))
    assert len({c.text for c in full.choices}) > 1


def test_echo_prompt_logprobs_cold_and_warm_cache(http):  # C07
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    runs = []
    for _ in range(2):
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        runs.append(r.json())
    for body_ in runs:
        choice, usage = body_["choices"][0], body_["usage"]
        lp = choice["logprobs"]
        assert choice["text"].startswith(PROMPTS[0])
        n = usage["prompt_tokens"] + usage["completion_tokens"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(math.isfinite(x) and x <= 0 for x in lp["token_logprobs"][1:])
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        for tok, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]):
            assert len(top) in (2, 3) and (len(top) == 2 or tok in top)
    cold, warm = (b["choices"][0]["logprobs"]["token_logprobs"][1:] for b in runs)
    assert all(abs(x - y) <= 1e-4 for x, y in zip(cold, warm))


# ---------------------------------------------------------------------------- chat
def test_chat_greedy_equals_offline_chat_and_stream_protocol(client, served, http):
    ref = served.refs["chat"]
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=48, temperature=0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    for special in ("<|im_end|>", "<|im_start|>", "<|endoftext|>"):  # C25
        assert special not in choice.message.content
    if ref.outputs[0].token_ids[-1] == 2:
        assert choice.finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=48, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content and finishes == [choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_chat_logprobs_top5(client):  # C20
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0.7, top_p=0.3,
                                          seed=1, logprobs=True, top_logprobs=5)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for pos in content:
        values = [t.logprob for t in pos.top_logprobs]
        assert len(values) == 5 and len({t.token for t in pos.top_logprobs}) == 5
        assert values == sorted(values, reverse=True) and all(math.isfinite(v) for v in values)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5
        if pos.token in [t.token for t in pos.top_logprobs]:
            assert pos.logprob == pytest.approx(values[[t.token for t in pos.top_logprobs].index(pos.token)])
    greedy = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                            top_logprobs=3)
    for pos in greedy.choices[0].logprobs.content:
        assert pos.token == pos.top_logprobs[0].token


def test_chat_template_rendering_one_bos(http):  # C30
    cases = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}],
    ]
    tail = http.post("/tokenize", json={"prompt": "<|im_start|>assistant\n", "add_special_tokens": False}).json()["tokens"]
    for i, messages in enumerate(cases):
        ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert ids[0] == 1 and ids[1] != 1 and ids[-len(tail):] == tail
        if i == 0:
            assert text == (f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                            "<|im_start|>assistant\n")
        if i == 1:
            assert DEFAULT_SYSTEM not in text and text.count("Be brief.") == 1
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == len(ids)


# ---------------------------------------------------------------------------- limits and errors
def test_context_length_limits(http):  # C11
    long_ids = [28] * 300
    cases = [
        ("/v1/completions", {"prompt": long_ids, "max_tokens": 16}, ("256", "300")),
        ("/v1/completions", {"prompt": [28] * 200, "max_tokens": 100}, ("256", "300", "200", "100")),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 300}]}, ("256",)),
    ]
    for path, body, numbers in cases:
        t0 = time.monotonic()
        err = assert_error(http.post(path, json={"model": MODEL, **body}), 400)
        assert time.monotonic() - t0 < 2.0
        assert all(n in err["message"] for n in numbers), err["message"]
        assert err["param"] == ("messages" if "chat" in path else "prompt")  # the field, as OpenAI names it
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).status_code == 200
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [28] * 240, "max_tokens": None,
                                           "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["usage"]["completion_tokens"] <= MAX_MODEL_LEN - 240
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert http.get("/health").status_code == 200


def test_bad_input_table_with_the_openai_client(client, served):  # C27
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="does-not-exist", prompt="Hi", max_tokens=1)
    assert "does-not-exist" in e.value.message and MODEL in e.value.message
    bad_chat = [dict(messages=[]), dict(messages=[{"role": "wizard", "content": "x"}]),
                dict(messages=CHAT, temperature=-1), dict(messages=CHAT, top_p=1.5), dict(messages=CHAT, n=0),
                dict(messages=CHAT, n=100000), dict(messages=CHAT, max_tokens=-5),
                dict(messages=CHAT, presence_penalty=5), dict(messages=CHAT, logprobs=True, top_logprobs=100)]
    for kw in bad_chat:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=MODEL, stream=stream, **{"max_tokens": 1, **kw})
            assert e.value.status_code == 400 and e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[[49152]], max_tokens=1)
    wrong = openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    r = httpx.post(served.url + "/v1/completions", content=b"{not json", timeout=10,
                   headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert_error(r, 400)
    ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_empty_prompts_rejected_engine_survives(http):  # C29
    for prompt in ("", [""], [], [[]]):
        assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": prompt}), 400, "prompt")
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": ""}],
                                                "max_tokens": 2})
    assert r.status_code == 200
    t0 = time.monotonic()
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert time.monotonic() - t0 < 5 and http.get("/health").status_code == 200


# ---------------------------------------------------------------------------- disconnect, load, faults
def test_disconnect_mid_stream_frees_blocks(http):
    before = http.get("/metrics").text
    used_before = metric(before, "num_kv_blocks_used")
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = 0
        while got < 3:
            if next(lines).startswith("data: "):
                got += 1
        assert metric(http.get("/metrics").text, "num_requests_running") == 1
    # Bounded wait for the engine thread's next step to observe the abort (not a speed
    # assertion: a loaded machine may take seconds per step).
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30.0:
        text = http.get("/metrics").text
        if metric(text, "num_kv_blocks_used") == used_before and metric(text, "num_requests_running") == 0:
            break
        time.sleep(0.02)
    assert metric(text, "num_kv_blocks_used") == used_before
    assert metric(text, "num_requests_running") == 0 and metric(text, "num_requests_waiting") == 0


@pytest.mark.slow
def test_load_concurrent_streaming_clients(served):
    num_clients, health_latencies = 48, []
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, str, list]:
        body = {"model": MODEL, "prompt": f"Request {i}: tell me about the number {i}.", "max_tokens": 6,
                "temperature": 0.8, "seed": i, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            return r.status_code, events[-1] if events else "", events

    async def probe(c: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = await c.get("/health")
            health_latencies.append((r.status_code, time.perf_counter() - t0))
            await asyncio.sleep(0.05)

    async def main():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=served.url, timeout=120, limits=limits, headers=headers) as c:
            stop = asyncio.Event()
            prober = asyncio.create_task(probe(c, stop))
            results = await asyncio.gather(*(one(c, i) for i in range(num_clients)))
            stop.set()
            await prober
            return results

    results = asyncio.run(main())
    assert [status for status, _, _ in results] == [200] * num_clients
    assert all(last == "[DONE]" for _, last, _ in results)
    for _, _, events in results:
        finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
        assert finishes in (["length"], ["stop"])
    assert health_latencies and all(status == 200 for status, _ in health_latencies)
    # /health latency under load is measured by benchmarks/serving.py, not asserted here.
    time.sleep(0.1)
    text = httpx.get(served.url + "/metrics").text
    assert metric(text, "num_kv_blocks_used") == 0 and metric(text, "num_requests_running") == 0


def test_model_fault_gives_errors_and_health_503_then_recovers(served, http):  # C29 fault hook
    runner = served.llm.llm_engine.runner
    original = runner.execute_model

    def broken(*args, **kwargs):
        raise RuntimeError("injected model fault")

    runner.execute_model = broken
    try:
        t0 = time.monotonic()
        err = assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}), 500)
        assert "injected model fault" in err["message"]
        assert_error(http.get("/health"), 503)
        assert time.monotonic() - t0 < 2.0
    finally:
        runner.execute_model = original
    assert http.get("/health").status_code == 200  # the probe succeeds again
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_continue_final_message_over_http_equals_offline(http, served):
    """The rendered prompt ends inside the assistant message and the model continues it."""
    body = {"model": MODEL, "messages": CONTINUE, "add_generation_prompt": False, "continue_final_message": True}
    tokens = http.post("/tokenize", json=body).json()["tokens"]
    assert served.llm.get_tokenizer().decode(tokens).endswith("three,")
    r = http.post("/v1/chat/completions", json={**body, "max_tokens": 12, "temperature": 0})
    ref = served.refs["continue"].outputs[0]
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref.text
    assert len(ref.token_ids) == 12
    both = http.post("/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_prompt_logprobs_over_http_equal_offline(http, served):
    ref = served.refs["prompt_logprobs"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0,
                                           "prompt_logprobs": 1})
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ref.prompt_token_ids) and got[0] is None and ref.prompt_logprobs[0] is None
    for entry, want in zip(got[1:], ref.prompt_logprobs[1:]):
        assert {int(t) for t in entry} == set(want)
        for t, lp in want.items():
            assert entry[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
            assert entry[str(t)]["rank"] == lp.rank
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1,
                                                   "prompt_logprobs": 1}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_truncate_prompt_tokens_keeps_the_last_tokens(http, served):
    """vLLM's ``truncate_prompt_tokens`` on completions and chat: the last N prompt tokens, the
    same greedy output as sending those N token ids; -1 keeps what fits beside max_tokens."""
    def complete(body: dict) -> dict:
        r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 6, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        return r.json()

    ids = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPTS[1]}).json()["tokens"]
    cut = complete({"prompt": PROMPTS[1], "truncate_prompt_tokens": 4, "echo": True})
    ref = complete({"prompt": ids[-4:]})
    assert cut["usage"]["prompt_tokens"] == 4
    kept = served.llm.get_tokenizer().decode(ids[-4:])
    assert cut["choices"][0]["text"] == kept + ref["choices"][0]["text"]  # echo: the prompt the model saw
    assert complete({"prompt": PROMPTS[1], "truncate_prompt_tokens": 256})["usage"]["prompt_tokens"] == len(ids)

    chat_ids = http.post("/tokenize", json={"model": MODEL, "messages": CHAT}).json()["tokens"]
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0,
                                                   "truncate_prompt_tokens": 5}).json()
    assert chat["usage"]["prompt_tokens"] == 5
    assert chat["choices"][0]["message"]["content"] == complete({"prompt": chat_ids[-5:]})["choices"][0]["text"]

    fit = complete({"prompt": [28] * 300, "truncate_prompt_tokens": -1})  # longer than max_model_len
    assert fit["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 6
    for value in (MAX_MODEL_LEN + 1, 0, -2):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "truncate_prompt_tokens": value})
        assert_error(r, 400, "truncate_prompt_tokens")
