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


def test_cache_salt_reaches_the_chat_request_of_responses_and_messages():
    from pagedllm.entrypoints.openai.protocol_messages import MessagesRequest
    from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
    from pagedllm.entrypoints.openai.serving_messages import to_chat_request as messages_chat
    from pagedllm.entrypoints.openai.serving_responses import to_chat_request as responses_chat

    responses = ResponsesRequest(model="m", input="hi", cache_salt="tenant-r")
    assert responses_chat(responses, [{"role": "user", "content": "hi"}]).to_sampling_params().cache_salt \
        == "tenant-r"
    messages = MessagesRequest(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               cache_salt="tenant-m")
    assert messages_chat(messages).to_sampling_params().cache_salt == "tenant-m"
    assert messages_chat(MessagesRequest(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
                         ).to_sampling_params().cache_salt is None
    with pytest.raises(ValueError):
        ResponsesRequest(model="m", input="hi", cache_salt="")


def test_the_tenant_salt_comes_before_the_request_salt():
    from pagedllm.entrypoints.openai.tenant_salt import key_salt, reset_tenant, salted, set_tenant
    from pagedllm.sampling_params import SamplingParams

    assert salted(SamplingParams()).cache_salt is None  # no key check: unchanged
    token = set_tenant(b"secret-key")
    try:
        salt = key_salt(b"secret-key")
        assert "secret" not in salt and salt != key_salt(b"other-key")
        assert salted(SamplingParams()).cache_salt == salt
        assert salted(SamplingParams(cache_salt="s")).cache_salt == f"{salt}/s"
    finally:
        reset_tenant(token)
