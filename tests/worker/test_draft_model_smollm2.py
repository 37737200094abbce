"""The draft-model proposer on the real default model (SmolLM2-135M-Instruct, float32 on CPU)
with a truncated copy of itself as the draft (its first layers, the same weights): greedy and
seeded outputs of batched chat prompts are those without speculation, across preemption and
chunked prefill, and both caches' blocks are free afterwards."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

CODE = "\n".join(f"def area_{i}(w, h):\n    return w * h * {i}\n" for i in range(8))
QUESTIONS = [f"Here is some code:\n{CODE}\nRewrite it with area_{i} renamed to size_{i}." for i in range(2)] + [
    "List the numbers from 1 to 30, separated by commas.", "What is the capital of France? Answer in one sentence."]


def _messages():
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


@pytest.fixture(scope="module")
def draft_dir(smollm2_path, tmp_path_factory):
    from tests.model_utils import write_truncated_copy

    return write_truncated_copy(str(smollm2_path), tmp_path_factory.mktemp("smollm2_draft"), list(range(12)))


def _llm(path, spec=None, **kw) -> LLM:
    kw.setdefault("max_model_len", 512)
    kw.setdefault("kv_cache_memory", "64MiB")
    return LLM(model=str(path), speculative_config=spec, **kw)


def test_greedy_and_seeded_outputs_with_a_truncated_draft(smollm2_path, draft_dir):
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 4}
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=24) for i in range(len(QUESTIONS))]
    plain = _llm(smollm2_path)
    want_greedy = plain.chat(_messages(), greedy, use_tqdm=False)
    want_seeded = plain.chat(_messages(), seeded, use_tqdm=False)
    # a pool for ~2 of the 4 sequences at once, 64-token chunks: preemption and chunked prefill
    llm = _llm(smollm2_path, spec, num_kv_blocks=20, max_num_batched_tokens=64, max_model_len=320,
               debug_integrity_checks=True)
    llm.llm_engine.drafter._draft_limits = lambda decoding, step_cost: [4] * len(decoding)  # always draft
    got_greedy = llm.chat(_messages(), greedy, use_tqdm=False)
    got_seeded = llm.chat(_messages(), seeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got_greedy] == [o.outputs[0].token_ids for o in want_greedy]
    assert [o.outputs[0].token_ids for o in got_seeded] == [o.outputs[0].token_ids for o in want_seeded]
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0
    stats = engine.scheduler.spec_decoding_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    proposer = engine.drafter.proposer
    assert engine.get_stats().num_used_blocks == 0 and proposer.num_free_blocks == proposer.num_blocks
