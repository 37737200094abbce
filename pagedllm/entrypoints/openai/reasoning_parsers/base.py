"""The reasoning-parser interface: a model's output → ``(reasoning, content)``, whole or streamed.

Whether the output starts inside the ``<think>`` block is decided at its start: an opening tag
in the output, else the prompt's verdict, else the parser's default. Streaming re-runs the
whole-output split on the text so far, so its pieces concatenate to that split. Whitespace
around the reasoning and before the answer is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReasoningSplit:
    """``reasoning`` None: the output has none; ``is_reasoning_done``: the block closed."""

    reasoning: str | None
    content: str
    is_reasoning_done: bool


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def prompt_reasoning_state(prompt_text: str, start: str = "<think>", end: str = "</think>") -> bool | None:
    """True when the prompt leaves a reasoning block open, False when its last block is closed
    after the last turn's start (thinking switched off), None when the prompt says nothing."""
    i, j = prompt_text.rfind(start), prompt_text.rfind(end)
    if i < 0 and j < 0:
        return None
    tail = prompt_text[max(i, j):]
    if len(tail.strip()) > max(len(start), len(end)) + 2:
        return None  # the tag belongs to an earlier turn, not to the generation prompt
    return i > j


class ReasoningParser:
    """One instance per generated sequence. ``starts_in_reasoning``: the prompt's verdict
    (:func:`prompt_reasoning_state`), None to let ``default_starts_in_reasoning`` decide."""

    start, end = "<think>", "</think>"
    default_starts_in_reasoning = False

    def __init__(self, starts_in_reasoning: bool | None = None) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self.text = ""
        self._sent_reasoning = 0
        self._sent_content = 0

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        raise NotImplementedError

    def split(self, text: str, is_final: bool = True) -> ReasoningSplit:
        """The split of ``text``; not final: hold back what later text could still change."""
        body = text.lstrip()
        in_reasoning = self.starts_in_reasoning
        if body.startswith(self.start):
            body, in_reasoning = body[len(self.start):], True
        elif not is_final and self.start.startswith(body):
            return ReasoningSplit(None, "", False)  # the opening tag may still be arriving
        if in_reasoning is None:
            in_reasoning = self.default_starts_in_reasoning
        if not in_reasoning:
            return ReasoningSplit(None, body, False)
        j = body.find(self.end)
        if j >= 0:
            return ReasoningSplit(body[:j].strip(), body[j + len(self.end):].lstrip(), True)
        held = 0 if is_final else _partial_suffix(body, self.end)
        return ReasoningSplit(body[:len(body) - held].strip(), "", False)

    def extract(self, text: str) -> tuple[str | None, str]:
        """``(reasoning, content)`` of a completed output."""
        s = self.split(text, True)
        return s.reasoning, s.content

    def stream(self, delta_text: str, is_final: bool = False) -> tuple[str | None, str | None]:
        """The ``(reasoning, content)`` pieces the next ``delta_text`` adds (None: nothing new)."""
        self.text += delta_text
        s = self.split(self.text, is_final)
        reasoning = (s.reasoning or "")[self._sent_reasoning:] or None
        content = s.content[self._sent_content:] or None
        self._sent_reasoning += len(reasoning or "")
        self._sent_content += len(content or "")
        return reasoning, content
