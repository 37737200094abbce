"""Swap preemption end to end on the tiny random Llama (float32, CPU): a request
preempted by swap produces exactly the tokens of an unpreempted run, the swap space
never leaks (integrity checked every step), and a full swap space falls back to
recompute. Prefix caching is off so that a resumed request cannot hide a bad swap-in
behind its own cached blocks."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams

_rng = random.Random(5)
PROMPTS = [{"prompt_token_ids": [_rng.randrange(3, 49152) for _ in range(_rng.randint(20, 120))]} for _ in range(10)]
# logprobs too: the tiny random model often repeats one token, so the tokens alone would
# hide K/V damage that the probabilities show
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)


def _tokens(llm: LLM) -> tuple[list[list[int]], list]:
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_used_blocks == 0 and stats.num_running == 0
    swap = llm.llm_engine.scheduler.swap_space
    assert swap.num_free_blocks == swap.num_blocks and not swap.swapped
    return [(o.outputs[0].token_ids, round(o.outputs[0].cumulative_logprob, 3)) for o in outs], outs


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    big = LLM(model=str(tiny_model_dir), max_model_len=256, num_kv_blocks=256, enable_prefix_caching=False)
    return _tokens(big)[0]


def _small(tiny_model_dir, **kw) -> LLM:
    # 10 prompts of up to ~145 tokens in 20 blocks of 16 tokens: they cannot all stay resident
    return LLM(model=str(tiny_model_dir), max_model_len=256, num_kv_blocks=20, enable_prefix_caching=False,
               debug_integrity_checks=True, **kw)


def test_swap_preemption_matches_unpreempted_run(tiny_model_dir, reference):
    tokens, outs = _tokens(_small(tiny_model_dir, preemption_mode="swap", swap_space="4MiB"))
    assert tokens == reference
    modes = [m for o in outs for m in o.metrics.preemption_modes]
    assert "swap" in modes and "recompute" not in modes


def test_full_swap_space_falls_back_to_recompute(tiny_model_dir, reference):
    # 2 blocks of 8 KiB: too small for any victim's computed blocks
    llm = _small(tiny_model_dir, preemption_mode="swap", swap_space=16 * 1024)
    tokens, outs = _tokens(llm)
    assert tokens == reference
    assert llm.llm_engine.scheduler.swap_space.num_fallbacks > 0
    assert "recompute" in {m for o in outs for m in o.metrics.preemption_modes}


def test_auto_mode_matches_unpreempted_run(tiny_model_dir, reference):
    llm = _small(tiny_model_dir, preemption_mode="auto", swap_space="4MiB")
    assert llm.llm_engine.scheduler.swap_space.copy_bytes_per_s > 0
    tokens, outs = _tokens(llm)
    assert tokens == reference
    assert sum(o.metrics.num_preemptions for o in outs) > 0


@pytest.mark.parametrize("kw, field", [({"preemption_mode": "page"}, "preemption_mode"),
                                       ({"swap_space": "-1GiB"}, "swap_space")])
def test_bad_preemption_settings_are_clear_errors(kw, field):
    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig(**kw)


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_swap_preemption_with_quantized_kv_matches_recompute(tiny_model_dir, name):
    """fp8 codes, and int8 codes with their per token-and-head scales, go to the swap space and
    back: the tokens and logprobs of recompute preemption and of an unpreempted run, same KV dtype."""
    big = LLM(model=str(tiny_model_dir), max_model_len=256, num_kv_blocks=256, enable_prefix_caching=False,
              kv_cache_dtype=name)
    reference = _tokens(big)[0]
    tokens, outs = _tokens(_small(tiny_model_dir, kv_cache_dtype=name, preemption_mode="swap", swap_space="4MiB"))
    assert {m for o in outs for m in o.metrics.preemption_modes} == {"swap"}
    recomputed, outs = _tokens(_small(tiny_model_dir, kv_cache_dtype=name, preemption_mode="recompute"))
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert tokens == recomputed == reference
