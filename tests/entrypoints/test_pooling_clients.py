"""Real clients of ``/v1/embeddings`` on a tiny random BERT (Matryoshka-enabled copy) against
transformers: the openai SDK (its default base64, float, ``dimensions``), langchain-openai's
``OpenAIEmbeddings`` and litellm's ``embedding()``; ``/v1/models`` lists the pooling tasks."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
import torch
import torch.nn.functional as F

from pagedllm.config import EngineConfig
from pagedllm.engine.async_pooling_engine import make_async_engine
from pagedllm.engine.pooling_engine import PoolingEngine
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.metrics import EngineMetrics
from bert_utils import TEXTS, bert_folder, cross_folder, reference_embeddings  # noqa: F401  (fixtures)
from server_utils import ServerThread

MODEL = "tiny-bert"


def _serve(folder) -> ServerThread:
    engine = make_async_engine(PoolingEngine(EngineConfig(model=str(folder))), metrics=EngineMetrics(MODEL),
                               stats_log_interval_s=0)
    return ServerThread(build_app(engine, [MODEL]))


@pytest.fixture(scope="module")
def served(bert_folder, tmp_path_factory):  # noqa: F811
    ref, tok, folder = bert_folder
    copy = tmp_path_factory.mktemp("matryoshka") / "bert"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [8, 16, 32]}))
    with _serve(copy) as srv:
        yield srv, reference_embeddings(ref, tok, TEXTS)


def _unnormalized(bert_folder):  # noqa: F811
    ref, tok, _ = bert_folder
    return reference_embeddings(ref, tok, TEXTS, normalize=False)


def test_openai_sdk_base64_float_and_dimensions(served, bert_folder):  # noqa: F811
    srv, reference = served
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    by_default = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and decodes it
    as_floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    for resp in (by_default, as_floats):
        torch.testing.assert_close(torch.tensor([d.embedding for d in resp.data]), reference, atol=1e-5, rtol=0)
    assert all(isinstance(d.embedding, str) for d in as_base64.data)  # returned as sent: base64 text
    short = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=16)
    expected = F.normalize(_unnormalized(bert_folder)[:, :16], dim=1)
    torch.testing.assert_close(torch.tensor([d.embedding for d in short.data]), expected, atol=1e-5, rtol=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="dog", dimensions=12)
    assert e.value.body["param"] == "dimensions"


def test_langchain_openai_embeddings(served):
    pytest.importorskip("langchain_openai")
    from langchain_openai import OpenAIEmbeddings

    srv, reference = served
    # check_embedding_ctx_length=False: send text, not tiktoken ids (langchain's setting for non-OpenAI servers)
    emb = OpenAIEmbeddings(model=MODEL, base_url=srv.url + "/v1", api_key="none", check_embedding_ctx_length=False,
                           max_retries=0)
    torch.testing.assert_close(torch.tensor(emb.embed_documents(TEXTS)), reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(emb.embed_query(TEXTS[1])), reference[1], atol=1e-5, rtol=0)


@pytest.mark.slow  # litellm's import alone takes seconds
def test_litellm_embedding(served, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import
    litellm = pytest.importorskip("litellm")
    srv, reference = served
    resp = litellm.embedding(model=f"openai/{MODEL}", input=TEXTS, api_base=srv.url + "/v1", api_key="none")
    got = torch.tensor([d["embedding"] for d in sorted(resp.data, key=lambda d: d["index"])])
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)
    assert resp.usage.prompt_tokens > 0


def test_models_list_the_pooling_tasks(served, cross_folder):  # noqa: F811
    srv, _ = served
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    assert client.models.list().data[0].model_dump()["tasks"] == ["embed", "score"]
    with _serve(cross_folder[2]) as cross:
        card = openai.OpenAI(base_url=cross.url + "/v1", api_key="none").models.retrieve(MODEL)
        assert card.model_dump()["tasks"] == ["classify", "score"]
