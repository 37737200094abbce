"""The documented bounds on what one request may ask for (docs/robustness.md): a clear error
naming the field beyond each, and the bound itself accepted."""

import pydantic
import pytest

from pagedllm.entrypoints.openai.errors import validation_message
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.sampling_params import (MAX_LOGIT_BIAS, MAX_N, MAX_PROMPTS, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                                      SamplingParams)


@pytest.mark.parametrize("kw, field", [
    ({"n": MAX_N + 1}, "n"),
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ({"stop": ["x" * (MAX_STOP_CHARS // 2), "y" * (MAX_STOP_CHARS // 2 + 1)]}, "stop"),
    ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
])
def test_beyond_a_bound_is_a_value_error_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_the_bounds_themselves_are_accepted():
    p = SamplingParams(n=MAX_N, stop=["x" * MAX_STOP_CHARS], logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)})
    assert p.n == MAX_N and len(p.stop[0]) == MAX_STOP_CHARS


def test_prompt_count_is_bounded():
    assert len(CompletionRequest(prompt=["a"] * MAX_PROMPTS).prompt) == MAX_PROMPTS
    for prompt in (["a"] * (MAX_PROMPTS + 1), [[1, 2]] * (MAX_PROMPTS + 1)):
        with pytest.raises(pydantic.ValidationError, match="prompt"):
            CompletionRequest(prompt=prompt)
    assert len(CompletionRequest(prompt=list(range(5000))).prompt) == 5000  # one prompt of token ids


@pytest.mark.parametrize("prompt", [["a"] * (MAX_PROMPTS + 1), [[1, 2]] * (MAX_PROMPTS + 1)])
def test_too_many_prompts_say_so_not_that_a_prompt_is_no_token_id(prompt):
    with pytest.raises(pydantic.ValidationError) as info:
        CompletionRequest(prompt=prompt)
    message, field = validation_message(info.value)
    assert field == "prompt"
    assert message == f"prompt: List should have at most {MAX_PROMPTS} items after validation, not {MAX_PROMPTS + 1}"
