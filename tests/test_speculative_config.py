"""``speculative_config``: vLLM's field names and defaults, every accepted form, errors naming
the field, and the ``--speculative-config`` flag reaching the config."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.config import EngineConfig, SpeculativeConfig


def test_off_by_default_and_every_form_parses():
    assert EngineConfig().speculative is None
    want = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
    for form in ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}',
                 {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
                 want):
        assert EngineConfig(speculative_config=form).speculative == want


def test_vllm_prompt_lookup_defaults():
    assert (SpeculativeConfig(num_speculative_tokens=2).prompt_lookup_min,
            SpeculativeConfig(num_speculative_tokens=2).prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    only_min = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize("value, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 1.5}, "speculative_config.suffix_decoding_min_token_prob"),
    ({"num_speculative_tokens": 2, "suffix_decoding_max_cached_requests": -1}, "speculative_config.suffix_decoding_max_cached_requests"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": " "}, "speculative_config.model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "speculative_config.model"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown keys \\['draft_model'\\]"),
    ("{not json", "speculative_config must be a JSON object"),
    ([1, 2], "speculative_config must be an object"),
])
def test_errors_name_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=value)


def test_the_flag_reaches_the_config():
    from pagedllm.entrypoints.args import engine_config_from_args
    from pagedllm.entrypoints.openai.api_server import add_server_args

    args = add_server_args(argparse.ArgumentParser()).parse_args(
        ["--speculative-config", '{"method": "suffix", "num_speculative_tokens": 4}'])
    spec = engine_config_from_args(args, model="m").speculative
    assert (spec.method, spec.num_speculative_tokens) == ("suffix", 4)
