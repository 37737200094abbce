"""Reasoning parsers: split a ``<think>`` block off the answer (``--reasoning-parser NAME``, vLLM's names)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning_parsers.base import (
    ReasoningParser, ReasoningSplit, prompt_reasoning_state)
from pagedllm.entrypoints.openai.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from pagedllm.entrypoints.openai.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser registered as ``name``. Raises ValueError listing the known names."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None


def detect_reasoning_parser(chat_template: str | None) -> type[ReasoningParser] | None:
    """The parser whose ``<think>`` format ``chat_template`` writes, or None."""
    for cls in REASONING_PARSERS.values():
        if chat_template and cls.matches_template(chat_template):
            return cls
    return None


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplit", "detect_reasoning_parser",
           "get_reasoning_parser", "prompt_reasoning_state"]
