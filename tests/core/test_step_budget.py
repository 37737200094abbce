"""StepBudget: a step's allowances, charged per request and given back in one call."""

import pytest

from pagedllm.core.step_budget import StepBudget
from pagedllm.core.step_cost import PrefillTimeBudget, StepCostCoefficients, StepCostModel
from core_helpers import make_config

# 1 s per step, 1 s per decode, 0.5 s per prompt token, attention pairs free.
FLAT = StepCostCoefficients(base=1.0, per_decode_token=1.0, per_prefill_token=0.5, per_kilo_pair=1e-9)


def test_take_and_give_back_round_trip():
    budget = StepBudget(64, 64)
    budget.take_prompt("a", 10, 0, 30)
    budget.take_decode("b", 5)
    budget.take_tokens("c", 7)
    assert (budget.num_tokens_left, budget.num_prompt_tokens_left, budget.num_scheduled_tokens) == (46, 54, 18)
    budget.give_back("a")
    assert (budget.num_tokens_left, budget.num_prompt_tokens_left) == (56, 64)
    budget.give_back("b")
    budget.give_back("c")
    assert (budget.num_tokens_left, budget.num_prompt_tokens_left, budget.num_scheduled_tokens) == (64, 64, 0)
    budget.give_back("never-charged")  # no-op
    assert budget.num_tokens_left == 64


def test_a_request_is_charged_once_per_step():
    budget = StepBudget(64, 64)
    budget.take_decode("a", 3)
    with pytest.raises(ValueError, match="'a'"):
        budget.take_prompt("a", 4, 0, 8)
    budget.give_back("a")
    budget.take_prompt("a", 4, 0, 8)  # after a give-back it may be charged again
    assert budget.num_tokens_left == 60


def test_prompt_cap_applies_only_while_decoding_with_chunked_prefill():
    config = make_config(max_prefill_tokens_while_decoding=16)
    assert StepBudget.for_step(config, StepCostModel(), is_decoding=False).num_prompt_tokens_left == 64
    budget = StepBudget.for_step(config, StepCostModel(), is_decoding=True)
    assert (budget.num_tokens_left, budget.num_prompt_tokens_left) == (64, 16)
    assert budget.prompt_limit(100, 0) == 16
    budget.take_decode("d", 9)
    budget.take_prompt("p", 16, 0, 100)
    assert (budget.num_tokens_left, budget.num_prompt_tokens_left, budget.has_prompt_room) == (47, 0, False)
    assert budget.prompt_limit(100, 0) == 0
    budget.give_back("p")
    assert (budget.num_tokens_left, budget.num_prompt_tokens_left, budget.has_prompt_room) == (63, 16, True)
    unchunked = make_config(max_prefill_tokens_while_decoding=16, enable_chunked_prefill=False)
    assert StepBudget.for_step(unchunked, StepCostModel(), is_decoding=True).num_prompt_tokens_left == 64
    assert StepBudget.for_step(make_config(), StepCostModel(), is_decoding=True).num_prompt_tokens_left == 64


def test_partial_prefill_slots_and_long_prompts():
    budget = StepBudget(100, 100, long_prefill_threshold=8, max_num_partial_prefills=2, max_long_partial_prefills=1)
    assert budget.is_long(9) and not budget.is_long(8)
    assert budget.prompt_limit(20, 0) == 8  # long: at most the threshold per step
    assert budget.prompt_limit(6, 0) == 100  # short: only the budget limits it
    budget.take_prompt("long", 8, 0, 20)  # leaves 12 of 20: a long partial prefill
    assert budget.partial_refusal(30, 8) == "long"
    assert budget.partial_refusal(30, 30) is None  # finishing a prompt needs no slot
    assert budget.partial_refusal(6, 4) is None
    budget.take_prompt("short", 4, 0, 6)
    assert budget.partial_refusal(6, 4) == "full"
    budget.take_prompt("whole", 5, 0, 5)  # finishes its prompt: takes no slot
    budget.give_back("long")
    assert budget.partial_refusal(30, 8) is None  # one slot (long allowed) free again
    assert (budget.num_tokens_left, budget.num_prompt_tokens_left) == (91, 91)


def test_time_budget_limits_prompt_chunks_only_while_decoding():
    model = StepCostModel(default=FLAT)
    budget = StepBudget(64, 64, PrefillTimeBudget(model, 2.2, None, min_tokens=4))
    assert budget.prompt_limit(20, 0) == 64  # nothing decodes: no time limit
    budget.take_decode("d", 3)
    # decode-only step 2 s, target 2.2 x 2 = 4.4 s: 2.4 s left = 4 prompt tokens of 0.5 s
    assert budget.prompt_limit(20, 0) == 4
    budget.take_prompt("p", 4, 0, 20)
    assert budget.prompt_limit(20, 4) == 0  # 0.4 s left: not one token
    budget.give_back("p")
    assert budget.prompt_limit(20, 0) == 4
    budget.give_back("d")  # its decode stays in the target: the step keeps its time limit
    assert (budget.num_tokens_left, budget.prompt_limit(20, 0)) == (64, 4)


def test_for_step_builds_the_time_budget_from_the_config():
    config = make_config(max_step_time_ratio=2.2)
    budget = StepBudget.for_step(config, StepCostModel(default=FLAT), is_decoding=True)
    assert budget.time_budget is not None and budget.time_budget.min_tokens == 4  # default: block_size
    budget.take_decode("d", 3)
    assert budget.prompt_limit(20, 0) == 4
    assert StepBudget.for_step(make_config(), StepCostModel(), is_decoding=True).time_budget is None
