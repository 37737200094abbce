"""DeepSeek-R1's reasoning: the template opens ``<think>`` in the prompt, so the output is
reasoning until ``</think>`` even without an opening tag (vLLM's ``deepseek_r1``)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    default_starts_in_reasoning = True

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return "<｜Assistant｜>" in chat_template and cls.end in chat_template
