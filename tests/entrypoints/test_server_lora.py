"""LoRA adapters over HTTP with the openai SDK on a tiny random Llama: ``model`` picks the adapter on
completions, chat, Responses and Messages (outputs equal PEFT's); ``/v1/models`` lists adapters with their
parent; run-time load and unload with their errors (outside the allowed folders, a bad adapter, in use)."""

from __future__ import annotations

import threading

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.metrics import EngineMetrics
from server_utils import ServerThread, assert_error
from tests.lora.lora_utils import peft_logprobs, write_base_folder, write_random_adapter

pytestmark = pytest.mark.slow
MODEL = "tiny-base"
PROMPT_IDS = [1, 5, 9, 33, 100, 7]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_server")
    base, folder = write_base_folder("llama", d / "base")
    allowed = d / "allowed"
    adapters = {"a1": write_random_adapter(base, allowed / "a1", seed=1),
                "a2": write_random_adapter(base, allowed / "a2", seed=2, r=4),
                "big": write_random_adapter(base, allowed / "big", seed=3, r=32),
                "outside": write_random_adapter(base, d / "outside", seed=4)}
    llm = LLM(model=str(folder), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=256, block_size=4,
              max_model_len=256, lora_modules=[f"a1={adapters['a1']}"], allow_runtime_lora_updating=True,
              lora_allowed_dirs=[str(allowed)])
    engine = AsyncLLMEngine(llm.llm_engine, metrics=EngineMetrics(MODEL), stats_log_interval_s=0)
    with ServerThread(build_app(engine, [MODEL], chat_template=TEMPLATE)) as srv:
        srv.base, srv.adapters, srv.tokenizer = base, adapters, llm.get_tokenizer()
        yield srv


def _client(srv):
    from openai import OpenAI

    return OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)


def _peft_greedy(srv, adapter: str | None, ids: list[int], n: int) -> str:
    """PEFT's greedy continuation of ``ids`` as the server's text of it."""
    ids = list(ids)
    for _ in range(n):
        ref = peft_logprobs(srv.base, None if adapter is None else srv.adapters[adapter], ids)
        ids.append(int(ref[-1].argmax()))
    return srv.tokenizer.decode(ids[-n:])


def _completion_ids(srv, model: str, n: int = 4) -> str:
    out = _client(srv).completions.create(model=model, prompt=PROMPT_IDS, max_tokens=n, temperature=0)
    assert out.model == MODEL
    return out.choices[0].text


def test_models_lists_adapters_with_parent(served):
    cards = {m.id: m for m in _client(served).models.list().data}
    assert set(cards) >= {MODEL, "a1"}
    assert cards["a1"].parent == MODEL and cards[MODEL].parent is None
    assert _client(served).models.retrieve("a1").root == str(served.adapters["a1"])


def test_model_chooses_the_adapter(served):
    assert _completion_ids(served, "a1") == _peft_greedy(served, "a1", PROMPT_IDS, 4)
    assert _completion_ids(served, MODEL) == _peft_greedy(served, None, PROMPT_IDS, 4)


def test_chat_responses_and_messages_take_the_adapter(served):
    client = _client(served)
    text = " ".join(f"t{i}" for i in PROMPT_IDS[1:])
    prompt_ids = served.tokenizer.encode(text + " ", add_special_tokens=False)  # the template's rendering
    expected = _peft_greedy(served, "a1", prompt_ids, 3)
    chat = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": text}], max_tokens=3,
                                          temperature=0)
    assert chat.choices[0].message.content == expected
    resp = client.responses.create(model="a1", input=text, max_output_tokens=3, temperature=0)
    assert resp.output_text == expected
    msg = httpx.post(f"{served.url}/v1/messages", json={"model": "a1", "max_tokens": 3, "temperature": 0,
                                                        "messages": [{"role": "user", "content": text}]})
    assert msg.status_code == 200, msg.text
    assert msg.json()["content"][0]["text"] == expected


def test_unknown_model_is_404(served):
    resp = httpx.post(f"{served.url}/v1/completions", json={"model": "nope", "prompt": "t5", "max_tokens": 1})
    assert "a1" in assert_error(resp, 404, "model")["message"]


def test_load_use_unload(served):
    url = served.url
    resp = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(served.adapters["a2"])})
    assert resp.status_code == 200, resp.text
    assert "a2" in {m.id for m in _client(served).models.list().data}
    assert _completion_ids(served, "a2") == _peft_greedy(served, "a2", PROMPT_IDS, 4)
    resp = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(served.adapters["a2"])})
    assert "already loaded" in assert_error(resp, 400)["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
    assert_error(httpx.post(f"{url}/v1/completions", json={"model": "a2", "prompt": "t5", "max_tokens": 1}), 404)
    assert_error(httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a2"}), 404)


@pytest.mark.parametrize("name,match", [("outside", "outside the folders"), ("big", "above max_lora_rank=8")])
def test_bad_loads_are_400_and_serving_goes_on(served, name, match):
    resp = httpx.post(f"{served.url}/v1/load_lora_adapter",
                      json={"lora_name": name, "lora_path": str(served.adapters[name])})
    assert match in assert_error(resp, 400, "lora_path")["message"]
    assert _completion_ids(served, "a1") == _peft_greedy(served, "a1", PROMPT_IDS, 4)


def test_unload_while_a_request_runs_is_409(served):
    started = threading.Event()

    def stream():
        with httpx.stream("POST", f"{served.url}/v1/completions", timeout=60,
                          json={"model": "a1", "prompt": PROMPT_IDS, "max_tokens": 240, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as resp:
            for _ in resp.iter_lines():  # the request runs until its last line
                started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(30)
    resp = httpx.post(f"{served.url}/v1/unload_lora_adapter", json={"lora_name": "a1"})
    thread.join(60)
    assert "unfinished requests" in assert_error(resp, 409, "lora_name")["message"]
    assert _completion_ids(served, "a1") == _peft_greedy(served, "a1", PROMPT_IDS, 4)
