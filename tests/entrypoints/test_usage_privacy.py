"""The server's request fields for cache isolation: ``cache_salt`` reaches SamplingParams on chat
and completions requests, and ``usage_cached_tokens`` off leaves every cached-token count out."""

import pytest

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, make_usage
from pagedllm.outputs import RequestMetrics


def test_cache_salt_reaches_the_sampling_params():
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], cache_salt="tenant-a")
    assert chat.to_sampling_params().cache_salt == "tenant-a"
    assert CompletionRequest(prompt="hi", cache_salt="t").to_sampling_params().cache_salt == "t"
    assert CompletionRequest(prompt="hi").to_sampling_params().cache_salt is None
    with pytest.raises(ValueError):
        CompletionRequest(prompt="hi", cache_salt="")


def test_usage_without_cached_tokens():
    m = RequestMetrics(arrival_time=0.0)
    m.cached_tokens_by_tier = {"pool": 32, "host": 0, "disk": 16}
    shown = make_usage(80, 4, 48, [m]).model_dump(exclude_none=True)
    assert shown["prompt_tokens_details"] == {"cached_tokens": 48}
    assert shown["metrics"]["cached_tokens_by_tier"] == {"pool": 32, "host": 0, "disk": 16}
    hidden = make_usage(80, 4, None, [m]).model_dump(exclude_none=True)
    assert "prompt_tokens_details" not in hidden and hidden["metrics"]["cached_tokens_by_tier"] == {}
    assert hidden["prompt_tokens"] == 80 and hidden["total_tokens"] == 84
