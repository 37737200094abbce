"""The serve flags of reasoning and tool parsing: every parser name accepted, values reach EngineConfig."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.entrypoints.args import engine_config_from_args
from pagedllm.entrypoints.openai.api_server import add_server_args
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"])
def test_every_tool_call_parser_name_is_a_flag_value(parser):
    args = add_server_args(argparse.ArgumentParser()).parse_args(["--tool-call-parser", parser])
    assert args.tool_call_parser == parser


def test_reasoning_and_template_flags_reach_the_config():
    args = add_server_args(argparse.ArgumentParser()).parse_args([
        "--reasoning-parser", "deepseek_r1", "--default-chat-template-kwargs", '{"enable_thinking": false}',
        "--generation-config", "vllm"])
    config = engine_config_from_args(args, model="m")
    assert (config.reasoning_parser, config.default_chat_template_kwargs, config.generation_config) == (
        "deepseek_r1", '{"enable_thinking": false}', "vllm")


def test_an_unknown_reasoning_parser_fails_at_start_up():
    from types import SimpleNamespace

    from pagedllm.config import EngineConfig

    engine = SimpleNamespace(config=EngineConfig(model="fake-model", reasoning_parser="nope"))
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        OpenAIServingChat(engine, ["m"])
