"""Qwen3's reasoning: the output opens ``<think>`` itself (or the template opened it in the
prompt); with ``enable_thinking: false`` the template closes an empty block in the prompt
and the whole output is the answer (vLLM's ``qwen3``)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    default_starts_in_reasoning = False

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return "<|im_start|>" in chat_template and cls.end in chat_template
