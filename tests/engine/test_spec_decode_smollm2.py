"""Speculative decoding on the real default model (SmolLM2-135M-Instruct, float32 on CPU):
greedy outputs of many batched prompts are the same with and without n-gram and suffix drafts,
also across preemption, chunked prefill, prefix hits, stop strings and structured outputs."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 5}
CODE = "\n".join(f"def area_{i}(w, h):\n    return w * h * {i}\n" for i in range(12))
QUESTIONS = [f"Here is some code:\n{CODE}\nRewrite it with area_{i} renamed to size_{i}." for i in range(3)] + [
    "List the numbers from 1 to 30, separated by commas.", "Repeat the word banana ten times.",
    "What is the capital of France? Answer in one sentence."]
MAX_TOKENS = 40


def _messages():
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


def _llm(path, spec=None, **kw) -> LLM:
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("kv_cache_memory", "128MiB")
    return LLM(model=str(path), speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain(smollm2_path):
    return _llm(smollm2_path)


@pytest.fixture(scope="module")
def reference(plain):
    return plain.chat(_messages(), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_batched_with_preemption_chunks_and_prefix_hits(smollm2_path, reference, spec):
    # a pool for ~2 of the 6 sequences at once, 64-token chunks: preemption and chunked prefill;
    # the four code prompts share their first blocks: prefix hits
    llm = _llm(smollm2_path, spec, num_kv_blocks=26, max_num_batched_tokens=64, max_model_len=384,
               debug_integrity_checks=True)
    outs = llm.chat(_messages(), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    sched = llm.llm_engine.scheduler
    assert sched.num_preemptions > 0 and sched.kv_cache_manager.prefix_cache_hits > 0
    assert sched.spec_decoding_stats.num_accepted_tokens > 0
    assert llm.llm_engine.get_stats().num_used_blocks == 0


def test_stop_strings_and_structured_outputs(smollm2_path, plain, reference):
    from pagedllm.sampling_params import StructuredOutputsParams as SO

    texts = [o.outputs[0].text for o in reference]
    stops = [t[len(t) // 2:len(t) // 2 + 5] for t in texts]  # from the middle of each reference answer
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[s] if s.strip() else None) for s in stops]
    schema = {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"}}},
              "required": ["numbers"]}
    params[3] = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=SO(json=schema))
    spec = _llm(smollm2_path, NGRAM)
    want = plain.chat(_messages(), params, use_tqdm=False)
    got = spec.chat(_messages(), params, use_tqdm=False)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == \
           [(o.outputs[0].text, o.outputs[0].finish_reason) for o in want]
    assert sum(o.outputs[0].stop_reason in stops for o in got) >= 4
