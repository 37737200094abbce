"""Decoders as embedders (runner='pooling' on a causal LM, Qwen3-Embedding style): the last prompt
token's final hidden state, normalized, against transformers' ``last_hidden_state`` on tiny random
Qwen3 and Llama folders (SmolLM2 vocabulary) and (slow) sentence-transformers on the same folder;
batched and alone, the prefix cache, over HTTP."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM
from pagedllm.engine.decoder_pooling import DecoderPoolingEngine
from tests.family_utils import family_config, make_hf_model

TEXTS = ["A man is eating food.", "Hello!", "Paged attention stores keys and values in fixed-size blocks of tokens.",
         "ok"]


@pytest.fixture(scope="module")
def qwen3_embedder(tmp_path_factory, smollm2_tokenizer):
    """A sentence-transformers folder around a tiny Qwen3: last-token pooling, then Normalize."""
    model = make_hf_model(family_config("qwen3", vocab_size=len(smollm2_tokenizer), max_position_embeddings=512))
    folder = tmp_path_factory.mktemp("qwen3_embedding")
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.pad_token = tokenizer.eos_token  # sentence-transformers pads its batches
    tokenizer.save_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False,
         "pooling_mode_cls_token": False}))
    return model, folder


def _reference(model, tokenizer, texts, normalize=True) -> torch.Tensor:
    """transformers, one text at a time (no padding): the last token of ``last_hidden_state``."""
    rows = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tokenizer(t)["input_ids"]])
            rows.append(model.model(ids).last_hidden_state[0, -1])
    pooled = torch.stack(rows)
    return F.normalize(pooled, dim=1) if normalize else pooled


def _embed(llm, prompts) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(prompts)])


def test_a_qwen3_embedding_folder_matches_transformers_batched_and_alone(qwen3_embedder, smollm2_tokenizer):
    model, folder = qwen3_embedder
    llm = LLM(str(folder), kv_cache_memory="64MiB")  # auto: a sentence-transformers folder -> pooling
    assert isinstance(llm.llm_engine, DecoderPoolingEngine) and llm.llm_engine.pooler.pooling_type == "LAST"
    reference = _reference(model, smollm2_tokenizer, TEXTS)
    batched = _embed(llm, TEXTS)
    alone = torch.cat([_embed(llm, t) for t in TEXTS])
    for got in (batched, alone):
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)
        assert F.cosine_similarity(got, reference).min() >= 0.99999
    score = llm.score(TEXTS[0], TEXTS[1])[0].outputs.score
    assert score == pytest.approx(float(reference[0] @ reference[1]), abs=1e-5)
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.generate("Hello")


@pytest.mark.slow
def test_a_qwen3_embedding_folder_matches_sentence_transformers(qwen3_embedder):
    from sentence_transformers import SentenceTransformer

    reference = torch.from_numpy(SentenceTransformer(str(qwen3_embedder[1]), device="cpu").encode(TEXTS))
    got = _embed(LLM(str(qwen3_embedder[1]), kv_cache_memory="64MiB"), TEXTS)
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)
    assert F.cosine_similarity(got, reference).min() >= 0.99999


def test_a_llama_with_runner_pooling_and_the_prefix_cache(tiny_model_dir, smollm2_tokenizer):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    llm = LLM(str(tiny_model_dir), runner="pooling", pooler_config='{"normalize": false}', kv_cache_memory="64MiB",
              block_size=16)
    prefix = " ".join(["the cache keeps this shared instruction"] * 8)
    texts = [prefix + " first query", prefix + " a second query"]
    first = _embed(llm, texts[0])
    hits_before = llm.llm_engine.get_stats().prefix_cache_hits
    second = _embed(llm, texts[1])
    assert llm.llm_engine.get_stats().prefix_cache_hits > hits_before  # the shared prefix was not recomputed
    torch.testing.assert_close(torch.cat([first, second]), _reference(model, smollm2_tokenizer, texts, normalize=False),
                               atol=1e-5, rtol=1e-5)


def test_a_decoder_pools_its_last_token_only(tiny_model_dir):
    with pytest.raises(ValueError, match="pooler_config: a decoder embedder pools its last token"):
        LLM(str(tiny_model_dir), runner="pooling", pooler_config='{"pooling_type": "MEAN"}')


def test_embeddings_over_http(qwen3_embedder, smollm2_tokenizer):
    from pagedllm.config import EngineConfig
    from pagedllm.engine.async_pooling_engine import make_async_engine
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.metrics import EngineMetrics
    from server_utils import ServerThread

    model, folder = qwen3_embedder
    engine = make_async_engine(DecoderPoolingEngine(EngineConfig(model=str(folder), kv_cache_memory="64MiB")),
                               metrics=EngineMetrics("qwen3-emb"), stats_log_interval_s=0)
    with ServerThread(build_app(engine, ["qwen3-emb"])) as srv:
        body = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS}, timeout=60).json()
        got = torch.tensor([d["embedding"] for d in body["data"]])
        torch.testing.assert_close(got, _reference(model, smollm2_tokenizer, TEXTS), atol=1e-5, rtol=0)
        assert body["usage"]["prompt_tokens"] == sum(len(smollm2_tokenizer(t)["input_ids"]) for t in TEXTS)
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["tasks"] == ["embed", "score"]
