"""C54 through the server: a schema that would take minutes to compile neither holds `/health` nor
another stream; it fails alone with a 400 naming the compile time limit. Bounds are relative to
that limit (what a compile on the serving path would hold), not timings of the feature."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("xgrammar")

from pagedllm.engine.async_engine import AsyncLLMEngine  # noqa: E402
from pagedllm.entrypoints.openai.api_server import build_app  # noqa: E402
from pagedllm.metrics import EngineMetrics  # noqa: E402
from server_utils import ServerThread, assert_error  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "tiny"
LIMIT_S = 4.0


def slow_schema(bound: int) -> dict:
    """C54's schema: its conversion is quadratic in the repetition bound (minutes at 40,000)."""
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": f"^[a-z]{{1,{bound}}}$"}},
            "required": ["s"]}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from pagedllm import LLM

    llm = LLM(model=str(tiny_model_dir), max_model_len=256, num_kv_blocks=64,
              structured_outputs_compile_timeout_s=LIMIT_S)
    llm.generate(["warm"], use_tqdm=False)
    engine = AsyncLLMEngine(llm.llm_engine, metrics=EngineMetrics(MODEL), stats_log_interval_s=0)
    with ServerThread(build_app(engine, [MODEL])) as srv:
        yield srv


def test_a_slow_schema_holds_neither_health_nor_another_stream(server):
    url = server.url
    with httpx.Client(timeout=120) as client:  # the compile process is started before the test
        client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1,
                                                   "structured_outputs": {"regex": "[ab]"}})
    done: dict[str, float] = {}
    slow: dict[str, httpx.Response] = {}

    def send_slow() -> None:
        with httpx.Client(timeout=120) as c:
            slow["resp"] = c.post(f"{url}/v1/completions", json={
                "model": MODEL, "prompt": "Name:", "max_tokens": 8, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "s", "schema": slow_schema(40002)}}})
        done["slow"] = time.monotonic()

    t0 = time.monotonic()
    sender = threading.Thread(target=send_slow)
    sender.start()
    health, arrivals, chunks = [], [], []
    with httpx.Client(timeout=120) as client:
        time.sleep(0.3)  # the slow compile has begun
        with client.stream("POST", f"{url}/v1/completions", json={
                "model": MODEL, "prompt": "Once upon", "max_tokens": 40, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    arrivals.append(time.monotonic())
                    chunks.append(json.loads(line[len("data: "):]))
        done["stream"] = time.monotonic()
        while "slow" not in done:
            start = time.monotonic()
            health.append((client.get(f"{url}/health").status_code, time.monotonic() - start))
            time.sleep(0.05)
    sender.join()
    err = assert_error(slow["resp"], 400)
    assert "structured_outputs_compile_timeout_s" in err["message"]
    assert done["slow"] - t0 >= LIMIT_S  # it ran until its limit ...
    assert done["stream"] < done["slow"]  # ... while the other stream ran to its end
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert max(b - a for a, b in zip(arrivals, arrivals[1:])) < LIMIT_S / 2  # no stall of the stream
    assert health and all(code == 200 for code, _ in health)
    assert max(seconds for _, seconds in health) < LIMIT_S / 2  # /health never waited on the compile
