"""Data parallelism through the OpenAI server: replica processes behind one front end.

Fast tests drive fake engines (tests/fake_engine.py's letter generator) in real replica
processes: streaming, n > 1, aborts when the client goes, per-replica metrics, prefix routing,
and a replica killed mid-stream (its request fails with an error naming it, /health turns
503 naming it, the other replica keeps serving). One test serves a tiny random model with
``--data-parallel-size 2`` and compares with ``LLM`` greedy output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import threading
import time
import uuid

import httpx
import pytest

from fake_replica import fake_replica
from pagedllm.config import EngineConfig
from pagedllm.engine.data_parallel import DataParallelAsyncEngine
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.metrics import EngineMetrics
from fake_engine import FakeEngine
from server_utils import ServerThread, sse_events

MODEL = "fake-model"


def make_dp_server(n: int = 2) -> tuple[ServerThread, DataParallelAsyncEngine]:
    config = EngineConfig(model=MODEL, max_model_len=512, block_size=4, data_parallel_size=n)
    engine = DataParallelAsyncEngine.from_config(config, engine_factory=fake_replica, front=FakeEngine(),
                                                 metrics=EngineMetrics(MODEL), log_requests=False,
                                                 stats_log_interval_s=0, start_timeout_s=120)
    return ServerThread(build_app(engine, [MODEL])), engine


@pytest.fixture(scope="module")
def dp():
    server, engine = make_dp_server()
    with server:
        server.engine = engine
        yield server
    for replica in engine.replicas:  # the app's shutdown stopped every replica process
        assert not replica.engine.process.is_alive()


def wait_until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def metric(text: str, name: str, engine: int, **labels) -> float:
    extra = "".join(f',{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf'^pagedllm:{name}\{{engine="{engine}"{extra},model_name="{MODEL}"\}} (\S+)$', text, re.M)
    assert m, f"{name} engine={engine} {labels} missing"
    return float(m.group(1))


def served_by_engine(client: httpx.Client) -> list[float]:
    text = client.get("/metrics").text
    return [sum(metric(text, "request_success_total", i, finished_reason=r) for r in ("length", "abort"))
            for i in range(2)]


def test_stream_and_n_through_two_replicas(dp):
    with httpx.Client(base_url=dp.url, timeout=30) as client:
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "n": 2, "stream": True}
        events = sse_events(client.post("/v1/completions", json=body).text)
        assert events[-1] == "[DONE]"
        texts = {0: "", 1: ""}
        for e in events[:-1]:
            for choice in json.loads(e)["choices"]:
                texts[choice["index"]] += choice["text"]
        assert texts == {0: "abcd", 1: "bcde"}  # sample i counts up the alphabet from 'a' + i
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": ["first one", "second"], "max_tokens": 3,
                                                    "n": 3})
        assert resp.status_code == 200
        assert [c["text"] for c in resp.json()["choices"]] == ["abc", "bcd", "cde"] * 2
        assert resp.json()["usage"]["prompt_tokens"] == len("first one") + len("second")
        chat = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})
        assert chat.json()["choices"][0]["message"]["content"] == "ab"
        bad = client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 600, "max_tokens": 1})
        assert bad.status_code == 400 and "maximum context length" in bad.json()["error"]["message"]
        assert client.get("/health").status_code == 200
        text = client.get("/metrics").text
        assert metric(text, "engine_healthy", 0) == metric(text, "engine_healthy", 1) == 1.0


def test_prompts_of_one_request_are_admitted_in_one_replica_turn(dp):
    def steps_before_adds() -> list[list[int]]:  # each replica's, read on its engine thread
        calls = [r.call(lambda proxy: proxy.call_engine("steps_before_adds")) for r in dp.engine.replicas]
        return [asyncio.run_coroutine_threadsafe(c, dp.engine._loop).result(10) for c in calls]

    before = steps_before_adds()
    with httpx.Client(base_url=dp.url, timeout=30) as client:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": ["p one", "p two", "p three", "p four"],
                                                 "max_tokens": 3})
        assert r.status_code == 200 and [c["text"] for c in r.json()["choices"]] == ["abc"] * 4
    new = [after[len(b):] for after, b in zip(steps_before_adds(), before)]
    (adds,) = [n for n in new if n]  # all four on one replica ...
    assert len(adds) == 4 and len(set(adds)) == 1  # ... added with no step between them


def test_requests_sharing_a_prefix_land_on_one_replica(dp):
    with httpx.Client(base_url=dp.url, timeout=30) as client:
        systems = [f"{uuid.uuid4().hex[:12]} system: " for _ in range(2)]  # differ from the first block on
        engines_of = []
        for system in systems:
            before = served_by_engine(client)
            for user in range(3):
                r = client.post("/v1/completions", json={"model": MODEL, "prompt": system + f"q{user}", "max_tokens": 1})
                assert r.status_code == 200
            after = served_by_engine(client)
            engines_of.append([i for i in range(2) if after[i] - before[i] == 3])
        assert len(engines_of[0]) == len(engines_of[1]) == 1 and engines_of[0] != engines_of[1]


def test_client_disconnect_aborts_on_its_replica(dp):
    with httpx.Client(base_url=dp.url, timeout=30) as client:
        before = client.get("/metrics").text
        aborted_before = [metric(before, "request_success_total", i, finished_reason="abort") for i in range(2)]
        body = {"model": MODEL, "prompt": "a long one", "max_tokens": 400, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as resp:
            # Keep the line iterator alive: a discarded one is closed at once, and closing it closes
            # the connection (httpcore), so the server could abort before the replica is looked up.
            lines = resp.iter_lines()
            next(lines)  # the stream has started on some replica
            index = next(i for i, r in enumerate(dp.engine.replicas) if r.num_active_streams)
        # the client is gone (leaving the block closes the response): the replica aborts the
        # request and frees its blocks
        wait_until(lambda: dp.engine.num_active_streams == 0
                   and dp.engine.replicas[index].stats.num_used_blocks == 0)
        after = client.get("/metrics").text
        assert metric(after, "request_success_total", index, finished_reason="abort") == aborted_before[index] + 1
        assert metric(after, "num_kv_blocks_used", index) == 0


def test_kv_state_per_replica(dp):
    with httpx.Client(base_url=dp.url, timeout=30) as client:
        assert client.get("/kv/state", params={"engine": 1}).status_code == 404  # the fake has no KV map
        bad = client.get("/kv/state", params={"engine": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "engine"


def test_killed_replica_fails_its_requests_and_health_names_it():
    server, engine = make_dp_server()
    with server, httpx.Client(base_url=server.url, timeout=30) as client:
        body = {"model": MODEL, "prompt": "doomed request", "max_tokens": 400, "stream": True}
        events: list[str] = []
        with client.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            events.append(next(lines))
            index = next(i for i, r in enumerate(engine.replicas) if r.num_active_streams)
            pid = engine.replicas[index].engine.process.pid
            os.kill(pid, signal.SIGKILL)
            events += [line for line in lines if line]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: "):])["error"]
        assert f"data-parallel engine {index} (pid {pid}) died (killed by signal 9" in error["message"]
        health = client.get("/health")
        assert health.status_code == 503
        assert f"data-parallel engine {index} (pid {pid}) died" in health.json()["error"]["message"]
        for k in range(3):  # the other replica serves everything now
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": f"doomed request {k}", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"
        text = client.get("/metrics").text
        assert metric(text, "engine_healthy", index) == 0.0 and metric(text, "engine_healthy", 1 - index) == 1.0
    assert not any(r.engine.process.is_alive() for r in engine.replicas)


@pytest.mark.parametrize("field,value", [("data_parallel_size", 0), ("data_parallel_size", -2),
                                         ("data_parallel_size", True), ("data_parallel_router", "random")])
def test_bad_data_parallel_values(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_bad_data_parallel_flags_and_llm_is_one_replica(capsys):
    from pagedllm import LLM
    from pagedllm.entrypoints.cli import main

    assert main(["serve", "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size must be a positive integer" in capsys.readouterr().err
    assert main(["serve", "--data-parallel-router", "random"]) == 2
    assert "--data-parallel-router" in capsys.readouterr().err
    with pytest.raises(ValueError, match="data_parallel_size=2: an LLMEngine .and LLM. is one replica"):
        LLM("no-such-model", data_parallel_size=2)


@pytest.mark.slow
def test_serve_tiny_model_with_two_replicas_equals_llm(tmp_path):
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.openai.api_server import add_server_args, build_app_from_args
    from tests.model_utils import write_random_llama_folder

    folder = write_random_llama_folder(tmp_path / "m", vocab_size=128, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                       max_position_embeddings=128)
    engine_flags = ["--max-model-len", "64", "--num-kv-blocks", "32", "--block-size", "4"]
    args = add_server_args(argparse.ArgumentParser()).parse_args(
        [str(folder), "--data-parallel-size", "2", "--disable-log-requests", "--stats-log-interval", "0",
         *engine_flags])
    prompts = [[1, 5 + k, 9, 11, 20, 3 * k + 4, 7] for k in range(4)]  # distinct first blocks: spread by load
    llm = LLM(str(folder), max_model_len=64, num_kv_blocks=32, block_size=4)
    expected = [o.outputs[0].text for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        use_tqdm=False)]
    server = ServerThread(build_app_from_args(args))
    with server, httpx.Client(base_url=server.url, timeout=60) as client:
        texts = []
        for p in prompts:
            r = client.post("/v1/completions", json={"model": str(folder), "prompt": p, "max_tokens": 6,
                                                     "temperature": 0.0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert texts == expected
        text = client.get("/metrics").text
        served = [float(m) for m in re.findall(
            r'^pagedllm:request_success_total\{engine="(?:0|1)",finished_reason="length",model_name="[^"]*"\} (\S+)$',
            text, re.M)]
        assert len(served) == 2 and min(served) >= 1 and sum(served) == 4  # both replicas served
        kv = client.get("/kv/state", params={"engine": 1}).json()
        assert kv["engine"] == 1 and len(kv["block_states"]) == 32


def test_tensor_parallel_ranks_share_their_replicas_cores(monkeypatch):
    """A replica's TP ranks split the replica's cores (set by the replica), not the machine's."""
    from pagedllm.envs import ENGINE_CORES
    from pagedllm.worker.worker import threads_per_rank

    ENGINE_CORES_ENV = ENGINE_CORES.name

    monkeypatch.delenv(ENGINE_CORES_ENV, raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert threads_per_rank(2) == 4
    monkeypatch.setenv(ENGINE_CORES_ENV, "4")  # a replica of data_parallel_size 2 on 8 cores
    assert [threads_per_rank(n) for n in (1, 2, 4, 8)] == [4, 2, 1, 1]
