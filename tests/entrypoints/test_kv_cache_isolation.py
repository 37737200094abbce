"""Prefix-cache namespaces through the server: ``--kv-cache-isolation api-key`` gives each API key its
own (a tenant never reads another's cached blocks, nor their count), and ``cache_salt`` partitions
the cache on every generating API (chat, completions, Responses, Messages)."""

from __future__ import annotations

import httpx
import pytest

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.metrics import EngineMetrics
from server_utils import ServerThread

pytestmark = pytest.mark.slow

MODEL = "tiny"
PROMPT = " ".join(f"word{i}" for i in range(60))  # several full blocks


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from pagedllm import LLM

    llm = LLM(model=str(tiny_model_dir), max_model_len=512, num_kv_blocks=256)
    engine = AsyncLLMEngine(llm.llm_engine, metrics=EngineMetrics(MODEL), stats_log_interval_s=0)
    with ServerThread(build_app(engine, [MODEL], api_key=["key-a", "key-b"], kv_cache_isolation="api-key")) as srv:
        yield srv


def _cached(url: str, key: str, prompt: str, **extra) -> int:
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_each_api_key_has_its_own_prefix_cache(server):
    prompt = "alpha " + PROMPT
    assert _cached(server.url, "key-a", prompt) == 0
    assert _cached(server.url, "key-a", prompt) > 0  # the same tenant reuses its blocks
    assert _cached(server.url, "key-b", prompt) == 0  # another key sees none of them
    assert _cached(server.url, "key-a", prompt, cache_salt="s1") == 0  # a salt is a namespace inside a key's
    assert _cached(server.url, "key-b", prompt) > 0


def test_cache_salt_partitions_responses_and_messages(server):
    auth = {"Authorization": "Bearer key-a"}

    def responses(salt: str) -> int:
        r = httpx.post(f"{server.url}/v1/responses", headers=auth, timeout=60, json={
            "model": MODEL, "input": "beta " + PROMPT, "max_output_tokens": 1, "cache_salt": salt, "store": False})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens_details"]["cached_tokens"]

    def messages(salt: str) -> int:
        r = httpx.post(f"{server.url}/v1/messages", headers=auth, timeout=60, json={
            "model": MODEL, "max_tokens": 1, "cache_salt": salt,
            "messages": [{"role": "user", "content": "gamma " + PROMPT}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["cache_read_input_tokens"]

    for call, salts in ((responses, ("r1", "r2")), (messages, ("m1", "m2"))):
        assert call(salts[0]) == 0
        assert call(salts[0]) > 0
        assert call(salts[1]) == 0
