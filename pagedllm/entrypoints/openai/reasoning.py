"""Reasoning on the chat path: the ``<think>`` block as ``reasoning_content`` / ``reasoning``, whole and
streamed, and ``usage.completion_tokens_details.reasoning_tokens``. Where the output starts is read from
the prompt's end. Under an output constraint the grammar starts after the reasoning block
(``plan.boundary``, vLLM's default); with ``enable_in_reasoning`` it covers the whole output, so only an
opening tag the grammar writes starts a block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pagedllm.entrypoints.openai.reasoning_parsers import (
    ReasoningParser, detect_reasoning_parser, get_reasoning_parser, prompt_reasoning_state)
from pagedllm.sampling_params import ReasoningBoundary

_PROMPT_TAIL_TOKENS = 16


@dataclass
class ReasoningPlan:
    """A request's reasoning split: ``starts_in_reasoning`` as the parsers take it; ``end_token_id``
    the id of the end tag when it is one token (counts reasoning tokens exactly); ``boundary``: where
    an output constraint starts (None: it covers the whole output)."""

    parser_cls: type[ReasoningParser]
    starts_in_reasoning: bool | None
    end_token_id: int | None
    boundary: ReasoningBoundary | None = None

    def new_parser(self) -> ReasoningParser:
        return self.parser_cls(self.starts_in_reasoning)

    def num_tokens(self, token_ids: list[int], text: str, encode: Callable[[str], list[int]]) -> int:
        """Reasoning tokens of an output: those before the end tag, all of them when cut inside it."""
        split = self.new_parser().split(text)
        if split.reasoning is None:
            return 0
        if self.end_token_id is not None and self.end_token_id in token_ids:
            return token_ids.index(self.end_token_id)
        return len(encode(split.reasoning)) if split.is_reasoning_done else len(token_ids)


def resolve_reasoning_parser(name: str | None, chat_template: str | None) -> type[ReasoningParser] | None:
    """``name``'s parser (ValueError for an unknown one), else the template's, else None."""
    return get_reasoning_parser(name) if name else detect_reasoning_parser(chat_template)


def plan_reasoning(parser_cls: type[ReasoningParser] | None, tokenizer: Any, prompt_ids: list[int],
                   is_constrained: bool, template_kwargs: dict[str, Any],
                   enable_in_reasoning: bool = False) -> ReasoningPlan | None:
    """The request's split. ``is_constrained``: it has an output constraint, which covers the reasoning
    with ``enable_in_reasoning`` (no block unless the grammar writes one), else starts after it."""
    if parser_cls is None:
        return None
    if (is_constrained and enable_in_reasoning) or template_kwargs.get("enable_thinking") is False \
            or template_kwargs.get("thinking") is False:
        starts = False
    else:
        starts = prompt_reasoning_state(tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False),
                                        parser_cls.start, parser_cls.end)
    end_ids = tokenizer.encode(parser_cls.end, add_special_tokens=False)
    boundary = None
    if is_constrained and starts is not False:
        inside = parser_cls.default_starts_in_reasoning if starts is None else starts
        start_ids = () if inside else tuple(tokenizer.encode(parser_cls.start, add_special_tokens=False))
        boundary = ReasoningBoundary(tuple(end_ids), start_ids)
    return ReasoningPlan(parser_cls, starts, end_ids[0] if len(end_ids) == 1 else None, boundary)


def split_reasoning(plan: ReasoningPlan | None, text: str) -> tuple[str | None, str]:
    """``(reasoning, answer)`` of a finished output (no plan: no reasoning)."""
    if plan is None:
        return None, text
    return plan.new_parser().extract(text)


class ReasoningStream:
    """Per-choice streaming state: text deltas → ``(reasoning, answer)`` deltas, and token counts."""

    def __init__(self, plan: ReasoningPlan | None) -> None:
        self.plan = plan
        self._parsers: dict[int, ReasoningParser] = {}
        self._token_ids: dict[int, list[int]] = {}

    def delta(self, index: int, text: str, token_ids: list[int], finish_reason: str | None
              ) -> tuple[str | None, str]:
        if self.plan is None:
            return None, text
        parser = self._parsers.setdefault(index, self.plan.new_parser())
        self._token_ids.setdefault(index, []).extend(token_ids)
        reasoning, answer = parser.stream(text, is_final=finish_reason is not None)
        return reasoning, answer or ""

    def num_tokens(self, encode: Callable[[str], list[int]]) -> int:
        if self.plan is None:
            return 0
        return sum(self.plan.num_tokens(self._token_ids[i], p.text, encode) for i, p in self._parsers.items())
