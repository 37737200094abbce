"""The step-cost model and the time-aware prompt-token budget (max_step_time_ratio / _ms).

The policy is driven with synthetic step costs: a fake clock whose step time is a known
linear function of the step's shape, fed to the scheduler as the engine would
(``observe_step_time``), so every decision is deterministic.
"""

from __future__ import annotations

import random

import pytest

from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step_cost import (PrefillTimeBudget, StepCostCoefficients, StepCostModel, StepShape,
                                     attention_pairs)

from core_helpers import FakeRunner, make_config, make_request, reference_output, run_to_completion

# Costs whose prefill-vs-decode shape differs from the default's (the model must learn it).
TRUE = StepCostCoefficients(base=0.1, per_decode_token=0.01, per_prefill_token=0.004, per_kilo_pair=0.002)
# No attention term to speak of: the policy tests' chunk sizes are exact by hand.
FLAT = StepCostCoefficients(base=1.0, per_decode_token=1.0, per_prefill_token=0.5, per_kilo_pair=1e-9)
STEEP = StepCostCoefficients(base=1.0, per_decode_token=1.0, per_prefill_token=10.0, per_kilo_pair=1e-9)


def _seconds(shape: StepShape, coef: StepCostCoefficients = TRUE) -> float:
    return float(shape.features() @ coef.as_array())


def test_attention_pairs_count_causal_query_key_pairs():
    assert attention_pairs(0, 1) == 1
    assert attention_pairs(10, 1) == 11  # a decode sees its context and itself
    assert attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(5, 3) == 6 + 7 + 8


def test_model_learns_synthetic_costs_and_follows_a_load_change():
    model = StepCostModel()
    rng = random.Random(0)
    probes = [StepShape(32, 0, 32 * 200), StepShape(1, 64, 200 + attention_pairs(1000, 64)),
              StepShape(16, 128, 16 * 100 + attention_pairs(0, 128))]
    for _ in range(200):
        d, p, c = rng.randint(1, 48), rng.choice([0, 0, 0, 16, 64, 128]), rng.randint(0, 3000)
        shape = StepShape(d, p, d * 200 + attention_pairs(c, p))
        model.observe(shape, _seconds(shape))
    for shape in probes:  # the default's shape is ~3x off in the prefill/decode ratio; the fit is not
        assert model.predict(shape) == pytest.approx(_seconds(shape), rel=0.2)
    slow = StepCostCoefficients(*(3 * c for c in TRUE.as_array()))  # other processes take the cores
    for _ in range(60):
        d, p, c = rng.randint(1, 48), rng.choice([0, 0, 0, 16, 64, 128]), rng.randint(0, 3000)
        shape = StepShape(d, p, d * 200 + attention_pairs(c, p))
        model.observe(shape, _seconds(shape, slow))
    for shape in probes:
        assert model.predict(shape) == pytest.approx(_seconds(shape, slow), rel=0.2)


def test_one_outlier_moves_the_fit_by_a_bounded_step_and_junk_is_ignored():
    model = StepCostModel(default=TRUE)
    shape = StepShape(8, 0, 800)
    for _ in range(20):
        model.observe(shape, _seconds(shape))
    before = model.predict(shape)
    model.observe(shape, 1000 * before)  # a page-fault storm
    assert before < model.predict(shape) < 4 * before
    n = model.num_observations
    for junk in (0.0, -1.0, float("nan"), float("inf")):
        model.observe(shape, junk)
    model.observe(StepShape(), 1.0)  # an empty step says nothing
    assert model.num_observations == n
    assert all(c > 0 for c in model.coefficients.as_array())



def test_a_load_rise_seen_only_on_mixed_steps_makes_prompt_tokens_dearer_not_decodes():
    model = StepCostModel(default=TRUE)
    decode_only, mixed = StepShape(24, 0, 24 * 300), StepShape(24, 256, 24 * 300 + attention_pairs(0, 256))
    for _ in range(30):
        model.observe(decode_only, _seconds(decode_only))
    slow = StepCostCoefficients(*(2 * c for c in TRUE.as_array()))
    for _ in range(30):  # every step now carries a chunk, and the machine got 2x slower
        model.observe(mixed, _seconds(mixed, slow))
    assert model.predict(mixed) == pytest.approx(_seconds(mixed, slow), rel=0.05)
    assert model.predict(decode_only) == pytest.approx(_seconds(decode_only), rel=0.25)  # not 2x
    assert model.coefficients.per_prefill_token > 2 * TRUE.per_prefill_token

def test_max_prefill_tokens_is_the_largest_chunk_within_the_time():
    model = StepCostModel(default=TRUE)
    for context in (0, 100, 5000):
        for seconds in (0.01, 0.3, 2.0):
            n = model.max_prefill_tokens(seconds, context)
            assert model.prefill_seconds(context, n) <= seconds < model.prefill_seconds(context, n + 1)
    assert model.max_prefill_tokens(0.0, 0) == 0 and model.max_prefill_tokens(-1.0, 0) == 0
    # deeper into a long prompt a token costs more: fewer of them fit
    assert model.max_prefill_tokens(1.0, 5000) < model.max_prefill_tokens(1.0, 0)


@pytest.mark.parametrize("kw, field", [(dict(decay=0.0), "decay"), (dict(decay=1.5), "decay"),
                                       (dict(prior_weight=-1), "prior_weight"),
                                       (dict(default=StepCostCoefficients(0, 1, 1, 1)), "coefficient")])
def test_model_arguments_are_validated(kw, field):
    with pytest.raises(ValueError, match=field):
        StepCostModel(**kw)


def test_budget_fixes_its_target_at_the_first_chunk_and_gives_back():
    model = StepCostModel(default=FLAT)
    budget = PrefillTimeBudget(model, 2.2, None, min_tokens=4)
    assert budget.limit(0) is None  # no decode in the step: no time limit
    budget.add_decode(3)
    assert budget.limit(0) == 4  # decode step 2 s (base 1 + 1 decode), target 4.4 s: 2.4 s = 4 tokens
    budget.take("x", 0, 4)
    assert budget.limit(0) == 0  # 0.4 s left: not one token (and the minimum is for the first chunk)
    budget.give_back("x")
    assert budget.limit(0) == 4


# ---- the scheduler's policy on synthetic step costs --------------------------------------
def _scheduler(coef: StepCostCoefficients = FLAT, **kw) -> Scheduler:
    s = Scheduler(make_config(**kw), num_kv_blocks=kw.pop("num_kv_blocks", 40), record_trace=True)
    s.step_cost = StepCostModel(default=coef)  # nothing observed: predictions are exactly ``coef``
    return s


def _decoding(s: Scheduler, r: FakeRunner, *rids: str) -> list:
    reqs = [make_request(rid, [1, 2], max_tokens=40) for rid in rids]
    for req in reqs:
        s.add_request(req)
    r.step()  # their prompts: nothing decodes yet, the whole budget
    return reqs


def _first_chunk_beside_a_decode(**config) -> dict:
    """The step trace of a 20-token prompt's first step while request "a" decodes."""
    s = _scheduler(**config)
    r = FakeRunner(s)
    _decoding(s, r, "a")
    s.add_request(make_request("L", list(range(3, 23)), max_tokens=1))
    r.step()
    return s.step_trace[-1]


def test_prompt_chunks_fill_the_step_up_to_the_ratio_of_a_decode_step():
    s = _scheduler(max_step_time_ratio=2.2)
    r = FakeRunner(s)
    reqs = _decoding(s, r, "a")
    long = make_request("L", list(range(3, 23)), max_tokens=1)  # 20 tokens
    s.add_request(long)
    reqs.append(long)
    for _ in range(6):
        r.step()
    # a decode step = 2 s (base 1 + 1 decode); 2.2x = 4.4 s: 2.4 s of prompt = 4 tokens
    assert s.step_trace[1:7] == [{"a": 1, "L": 4}] * 5 + [{"a": 1}]
    _decoding(s, r, "b")  # two decoders: 3 s; 6.6 s: 3.6 s of prompt = 7 tokens
    s.add_request(make_request("M", list(range(30, 50)), max_tokens=1))
    r.step()
    assert s.step_trace[-1] == {"a": 1, "b": 1, "M": 7}
    run_to_completion(r)
    assert long.output_token_ids == reference_output(long.prompt_token_ids, 1, 64)
    assert s.kv_cache_manager.num_used_blocks == 0


def test_millisecond_target_gives_slack_when_decode_steps_are_short():
    # max(4.4 s, 5.1 s) - 2 s = 3.1 s of prompt: 6 tokens
    assert _first_chunk_beside_a_decode(max_step_time_ratio=2.2, max_step_time_ms=5100) == {"a": 1, "L": 6}


def test_token_cap_and_long_prompt_threshold_still_bound_the_chunk():
    assert _first_chunk_beside_a_decode(max_step_time_ratio=2.2,
                                        max_prefill_tokens_while_decoding=3) == {"a": 1, "L": 3}
    assert _first_chunk_beside_a_decode(max_step_time_ratio=2.2, long_prefill_token_threshold=2) == {"a": 1, "L": 2}


def test_a_step_without_decodes_takes_the_whole_token_budget():
    s = _scheduler(max_step_time_ratio=1.0)
    FakeRunner(s).step()
    s.add_request(make_request("L", list(range(3, 43)), max_tokens=1))
    s.add_request(make_request("M", list(range(3, 13)), max_tokens=1))
    s.schedule()
    assert s.step_trace[-1] == {"L": 40, "M": 10}


def test_nothing_starves_when_no_prompt_token_fits_the_target():
    # prompt tokens cost 10 s each, the ratio-1 target leaves nothing: no prompt token fits by
    # the model; the step's first chunk still gets block_size (4) tokens, so prompts finish in FCFS order
    s = _scheduler(STEEP, max_step_time_ratio=1.0)
    r = FakeRunner(s)
    reqs = _decoding(s, r, "a")
    for rid, n, first in (("L", 10, 3), ("M", 5, 30)):
        reqs.append(make_request(rid, list(range(first, first + n)), max_tokens=2))
        s.add_request(reqs[-1])
    run_to_completion(r)
    assert s.step_trace[1:7] == [{"a": 1, "L": 4}, {"a": 1, "L": 4}, {"a": 1, "L": 2},
                                 {"a": 1, "L": 1, "M": 4}, {"a": 1, "M": 1}, {"a": 1, "M": 1}]
    for req in reqs:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, req.max_tokens, 64)
    assert s.kv_cache_manager.num_used_blocks == 0


def test_min_prefill_tokens_while_decoding_is_the_first_chunk_floor():
    s = _scheduler(STEEP, max_step_time_ratio=2.2, min_prefill_tokens_while_decoding=6)
    r = FakeRunner(s)
    _decoding(s, r, "a")
    s.add_request(make_request("L", list(range(3, 23)), max_tokens=1))
    s.add_request(make_request("M", list(range(30, 35)), max_tokens=1))
    for _ in range(2):
        r.step()
    # 2.4 s of room, a prompt token costs 10 s: the floor, and nothing for M behind L
    assert s.step_trace[1:3] == [{"a": 1, "L": 6}, {"a": 1, "L": 6}]
    with pytest.raises(ValueError, match="min_prefill_tokens_while_decoding"):
        make_config(min_prefill_tokens_while_decoding=0)


def test_steps_stay_within_the_target_once_the_model_has_learnt_the_costs():
    # the fake clock: every step takes TRUE's seconds for its shape; the model starts from
    # the default (3x off in shape and 10-50x in scale) and learns from what it observes
    s = Scheduler(make_config(max_step_time_ratio=2.0, max_num_batched_tokens=256, max_num_seqs=32,
                              max_model_len=512, block_size=16), num_kv_blocks=400, record_trace=True)
    r = FakeRunner(s)
    rng = random.Random(1)
    ratios = []
    for step in range(300):
        if step % 3 == 0 and len(s.requests) < 30:
            s.add_request(make_request(f"q{step}", [rng.randrange(3, 20) for _ in range(rng.randint(20, 300))],
                                       max_tokens=rng.randint(10, 60)))
        so = s.schedule()
        decode_pairs = sum(attention_pairs(s.requests[rid].num_computed_tokens, 1)
                           for rid, n in so.num_scheduled_tokens.items() if n == 1)
        s.update_from_output(so, r.execute(so))
        shape = so.step_shape
        s.observe_step_time(so, _seconds(shape))
        if step >= 50 and shape.num_decode_tokens and shape.num_prefill_tokens > 16:  # past the minimum chunk
            decode_only = StepShape(shape.num_decode_tokens, 0, decode_pairs)
            ratios.append(_seconds(shape) / _seconds(decode_only))
    assert len(ratios) > 30
    assert max(ratios) < 2.0 * 1.25  # within the target, up to the fit's error
    assert sorted(ratios)[len(ratios) // 2] > 1.5  # and the steps are used, not left idle


def test_preemption_and_abort_free_every_block_under_the_time_budget():
    s = _scheduler(max_step_time_ratio=1.5, num_kv_blocks=12, max_num_batched_tokens=16)
    r = FakeRunner(s)
    reqs = [make_request(f"r{i}", list(range(3 + i, 13 + i)), max_tokens=12) for i in range(4)]
    for req in reqs:
        s.add_request(req)
    for _ in range(6):
        r.step()
    s.abort_request("r3")
    run_to_completion(r)
    assert s.num_preemptions > 0
    for req in reqs[:3]:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, 12, 64)
    assert reqs[3].status == RequestStatus.FINISHED_ABORTED
    assert s.kv_cache_manager.num_used_blocks == 0
    s.check_integrity()


def test_step_time_targets_are_validated_by_name_and_on_the_command_line():
    import argparse

    from pagedllm.config import SERVING_CPU_MIN_PREFILL_TOKENS_WHILE_DECODING, SERVING_CPU_PREFILL_TOKENS_WHILE_DECODING
    from pagedllm.entrypoints.args import add_engine_args, engine_config_from_args

    for kw, field in [(dict(max_step_time_ratio=0.5), "max_step_time_ratio"),
                      (dict(max_step_time_ratio=-2.0), "max_step_time_ratio"),
                      (dict(max_step_time_ratio=float("inf")), "max_step_time_ratio"),
                      (dict(max_step_time_ratio=True), "max_step_time_ratio"),
                      (dict(max_step_time_ratio="2"), "max_step_time_ratio"),
                      (dict(max_step_time_ms=-1.0), "max_step_time_ms"),
                      (dict(max_step_time_ms=float("nan")), "max_step_time_ms")]:
        with pytest.raises(ValueError, match=field):
            make_config(**kw)
    assert not make_config().is_step_time_budget_on  # offline default: off
    assert not make_config(max_step_time_ratio=2.0, enable_chunked_prefill=False).is_step_time_budget_on
    cpu = make_config(max_step_time_ratio=2.0).with_serving_defaults("cpu")
    assert cpu.is_step_time_budget_on
    assert cpu.max_prefill_tokens_while_decoding is None  # the budget replaces the token cap
    assert cpu.min_prefill_tokens_while_decoding == SERVING_CPU_MIN_PREFILL_TOKENS_WHILE_DECODING  # ... a floor
    assert make_config(max_step_time_ratio=2.0, min_prefill_tokens_while_decoding=8).with_serving_defaults(
        "cpu").min_prefill_tokens_while_decoding == 8
    for off in (make_config(), make_config(max_step_time_ratio=0)):  # serve's default: off, the cap
        off = off.with_serving_defaults("cpu")
        assert not off.is_step_time_budget_on
        assert off.max_prefill_tokens_while_decoding == SERVING_CPU_PREFILL_TOKENS_WHILE_DECODING
    assert make_config().with_serving_defaults("cuda").max_step_time_ratio is None
    p = argparse.ArgumentParser()
    add_engine_args(p)
    config = engine_config_from_args(p.parse_args(["--max-step-time-ratio", "2.5", "--max-step-time-ms", "300"]))
    assert (config.max_step_time_ratio, config.max_step_time_ms) == (2.5, 300.0)


def test_a_burst_keeps_its_steps_within_the_target_while_every_step_carries_a_chunk():
    # 32 prompts arrive at once: after the first step every step mixes the streams decoding so
    # far with the next prompt's chunk, both growing together (no decode-only step to learn the
    # decode cost from). The fake clock's costs are TRUE's times a load factor drawn per step
    # in [0.4, 1.6] (other processes taking the cores); the model starts from the default.
    # One joint fit charged the noisy chunks to the decodes here and let steps reach 3.1x.
    s = Scheduler(make_config(max_step_time_ratio=2.0, max_num_batched_tokens=1024, max_num_seqs=32,
                              max_model_len=512, block_size=16), num_kv_blocks=1200, record_trace=True)
    r = FakeRunner(s)
    rng = random.Random(2)
    for i in range(32):
        s.add_request(make_request(f"q{i}", [rng.randrange(3, 20) for _ in range(256)], max_tokens=64))
    ratios = []
    while s.waiting or any(q.num_computed_tokens < q.num_prompt_tokens for q in s.running):
        so = s.schedule()
        decode_pairs = sum(attention_pairs(s.requests[rid].num_computed_tokens, 1)
                           for rid, n in so.num_scheduled_tokens.items() if n == 1)
        s.update_from_output(so, r.execute(so))
        shape = so.step_shape
        s.observe_step_time(so, _seconds(shape) * rng.uniform(0.4, 1.6))
        if shape.num_decode_tokens and shape.num_prefill_tokens > 16:
            ratios.append(_seconds(shape) / _seconds(StepShape(shape.num_decode_tokens, 0, decode_pairs)))
    assert len(ratios) > 20
    assert max(ratios) < 2.0 * 1.25
    assert sorted(ratios)[len(ratios) // 2] > 1.5
