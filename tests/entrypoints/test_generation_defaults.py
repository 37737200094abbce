"""generation_config.json sampling defaults: read per --generation-config mode, applied only to omitted fields;
--default-chat-template-kwargs parsing."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.generation_defaults import apply_generation_defaults, generation_defaults
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_chat import template_kwargs_of


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "eos_token_id": [1, 2],
         "do_sample": True, "max_new_tokens": 99}))
    return tmp_path


def test_defaults_by_mode(folder):
    assert generation_defaults(str(folder), str(folder)) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}
    assert generation_defaults(str(folder), "vllm") == {}
    assert generation_defaults("no-such-model-anywhere", "auto") == {}
    with pytest.raises(ValueError, match="generation_config"):
        generation_defaults(str(folder), str(folder / "missing"))


def test_a_request_field_wins_over_a_default(folder):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=1.0)
    apply_generation_defaults(req, generation_defaults(str(folder), str(folder)))
    params = req.to_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (1.0, 0.95, 20, 1.1)


def test_default_template_kwargs_parse():
    assert template_kwargs_of('{"enable_thinking": false}') == {"enable_thinking": False}
    assert template_kwargs_of(None) == {}
    for bad in ("[1]", "{nope"):
        with pytest.raises(ValueError, match="default_chat_template_kwargs"):
            template_kwargs_of(bad)


def test_template_kwargs_merge_and_reserved_names():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], reasoning_effort="low",
                                chat_template_kwargs={"a": 2})
    assert req.template_kwargs({"a": 1, "b": 1}) == {"a": 2, "b": 1, "reasoning_effort": "low"}
    with pytest.raises(ValueError, match="add_generation_prompt"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                              chat_template_kwargs={"add_generation_prompt": False}).template_kwargs()
