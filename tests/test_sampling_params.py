"""SamplingParams: vLLM defaults, normalization, and a ValueError naming the field for each bad value."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm.sampling_params import SAMPLING_EPS, RequestOutputKind, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs, p.seed) == (16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.bad_words == []
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert not p.is_greedy


def test_normalization():
    p = SamplingParams(stop="###", stop_token_ids=(5, 6), logit_bias={"12": 3, 4: -1.5}, allowed_token_ids=(1, 2))
    assert p.stop == ["###"] and p.stop_token_ids == [5, 6] and p.allowed_token_ids == [1, 2]
    assert p.logit_bias == {12: 3.0, 4: -1.5}
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(temperature=SAMPLING_EPS / 10), dict(top_k=1), dict(temperature=0.0, top_p=0.9),
])
def test_is_greedy(kwargs):
    assert SamplingParams(**kwargs).is_greedy


@pytest.mark.parametrize("kwargs", [
    dict(top_p=1e-9), dict(top_k=0), dict(top_k=-1), dict(top_k=10**6), dict(min_p=1.0), dict(min_p=0.0),
    dict(temperature=1e-6), dict(seed=-5), dict(seed=2**63 - 1), dict(logprobs=0), dict(prompt_logprobs=0),
    dict(max_tokens=None), dict(min_tokens=5, max_tokens=5), dict(presence_penalty=-2.0),
    dict(frequency_penalty=2.0), dict(repetition_penalty=0.5), dict(logit_bias={0: -100, 1: 100}),
    dict(truncate_prompt_tokens=-1), dict(truncate_prompt_tokens=1),
])
def test_valid_edge_values_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 1.5), ("n", True),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1),
    ("top_k", -2), ("top_k", 2.0),
    ("min_p", 1.5), ("min_p", -0.01),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", -3.0), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("seed", 2**63), ("seed", 1.0),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2), ("truncate_prompt_tokens", 2.0),
    ("stop", [""]), ("stop", [1]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", 7),
    ("bad_words", [""]), ("bad_words", "word"),
    ("max_tokens", 0), ("max_tokens", -1),
    ("min_tokens", -1),
    ("logprobs", -1), ("logprobs", 1.5),
    ("prompt_logprobs", -1),
    ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"x": 1.0}),
    ("logit_bias", {1: float("nan")}), ("logit_bias", [1, 2]),
    ("allowed_token_ids", []), ("allowed_token_ids", [-3]),
    ("ignore_eos", "yes"), ("include_stop_str_in_output", 1), ("skip_special_tokens", None),
    ("output_kind", "delta"),
])
def test_invalid_value_raises_naming_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_validate_for_model():
    SamplingParams(stop_token_ids=[9], logit_bias={9: 1}, allowed_token_ids=[9], logprobs=20).validate_for_model(10, 20)
    for kwargs, field in [(dict(stop_token_ids=[10]), "stop_token_ids"), (dict(allowed_token_ids=[10]), "allowed_token_ids"),
                          (dict(logit_bias={10: 1}), "logit_bias"), (dict(logprobs=21), "logprobs"),
                          (dict(prompt_logprobs=21), "prompt_logprobs")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs).validate_for_model(10, 20)


def test_child_gets_distinct_reproducible_seed_and_n_one():
    p = SamplingParams(n=4, seed=123, stop=["x"])
    kids = [p.child(i) for i in range(4)]
    assert [k.seed for k in kids] == [123, 124, 125, 126]
    assert all(k.n == 1 for k in kids) and p.n == 4
    kids[0].stop.append("y")
    assert p.stop == ["x"]  # deep copy
    assert SamplingParams(n=2).child(1).seed is None


def test_imports_without_torch():
    code = "import sys, pagedllm.sampling_params; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
