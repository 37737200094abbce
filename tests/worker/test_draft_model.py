"""The draft-model proposer end to end on tiny random Llamas sharing a vocabulary (float32 on
CPU): greedy and seeded outputs are those without speculation, the target as its own draft has
every draft accepted, preemption and abort free both caches' blocks, a vocabulary mismatch is
refused naming ``speculative_config.model``."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.worker.draft_model import common_prefix_length


def _spec(model_dir, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}


def _make(model_dir, spec=None, **kw) -> LLM:
    """An LLM; with ``spec`` it drafts k tokens every step (the step-cost rule, which weighs the
    draft model's own cost, would rightly stop a draft as slow as the target)."""
    kw.setdefault("max_model_len", 256)
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    llm = LLM(model=str(model_dir), speculative_config=spec, debug_integrity_checks=spec is not None, **kw)
    if spec is not None:
        k = spec["num_speculative_tokens"]
        llm.llm_engine.drafter._draft_limits = lambda decoding, step_cost: [k] * len(decoding)
    return llm


def _prompts(n: int, seed: int, shared: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(shared)]
    return [{"prompt_token_ids": prefix + [rng.randrange(3, 512) for _ in range(rng.randint(4, 50))]}
            for _ in range(n)]


def _proposer(llm: LLM):
    return llm.llm_engine.drafter.proposer


def _run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.get_stats().num_used_blocks == 0 and engine.get_stats().num_running == 0
    engine.scheduler.check_integrity()
    if engine.drafter is not None:
        assert _proposer(llm).num_free_blocks == _proposer(llm).num_blocks
    return outs


def _ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    from tests.model_utils import write_random_llama_folder

    return write_random_llama_folder(tmp_path_factory.mktemp("draft_llama"), seed=1, vocab_size=512, hidden_size=32,
                                     intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def plain(random_model_dir):
    return _make(random_model_dir)


@pytest.fixture(scope="module")
def self_draft(random_model_dir):
    return _make(random_model_dir, _spec(random_model_dir))


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_length([1, 2, 5, 6], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0


def test_the_target_as_its_own_draft_has_every_draft_accepted(plain, self_draft):
    prompts = _prompts(8, seed=1, shared=9)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert _ids(_run(self_draft, prompts, params)) == _ids(_run(plain, prompts, params))
    stats = self_draft.llm_engine.scheduler.spec_decoding_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_seeded_sampling_is_the_same(plain, self_draft):
    prompts = _prompts(4, seed=2)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=30, ignore_eos=True, logprobs=2)
              for i in range(4)]
    got, want = _run(self_draft, prompts, params), _run(plain, prompts, params)
    assert _ids(got) == _ids(want)
    for g, w in zip(got, want):
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-3)


def test_a_different_draft_keeps_greedy_outputs_batched_with_preemption(random_model_dir, other_draft_dir, plain):
    prompts = _prompts(10, seed=4, shared=12)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    tight = _make(random_model_dir, _spec(other_draft_dir, k=3), num_kv_blocks=40, max_model_len=128,
                  max_num_batched_tokens=24, max_num_seqs=6)
    got = _run(tight, prompts, params)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert tight.llm_engine.scheduler.spec_decoding_stats.num_draft_tokens > 0
    assert _ids(got) == _ids(_run(plain, prompts, params))


def test_abort_frees_both_caches_blocks(random_model_dir):
    llm = _make(random_model_dir, _spec(random_model_dir))
    engine = llm.llm_engine
    engine.add_request("x", _prompts(1, seed=5)[0], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    engine.add_request("y", _prompts(1, seed=6)[0], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    for _ in range(8):
        engine.step()
    proposer = _proposer(llm)
    assert engine.scheduler.spec_decoding_stats.num_draft_tokens > 0
    assert proposer.num_free_blocks < proposer.num_blocks
    engine.abort_request(["x", "y"])
    assert engine.get_stats().num_used_blocks == 0
    assert proposer.num_free_blocks == proposer.num_blocks
    engine.scheduler.check_integrity()


def test_the_step_cost_rule_counts_the_draft_models_cost(random_model_dir):
    llm = LLM(model=str(random_model_dir), speculative_config=_spec(random_model_dir), max_model_len=256,
              num_kv_blocks=256, block_size=4)
    _run(llm, _prompts(2, seed=7), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert _proposer(llm).seconds_per_draft_token() > 0.0


def test_a_draft_with_another_vocabulary_is_refused(random_model_dir, tmp_path):
    from tests.model_utils import write_random_llama_folder

    other = write_random_llama_folder(tmp_path / "v256", vocab_size=256, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"speculative_config\.model .*vocab_size 256.* 512"):
        _make(random_model_dir, _spec(other))
