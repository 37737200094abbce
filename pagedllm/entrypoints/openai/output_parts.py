"""A chat output as ordered parts (its reasoning, its text, then each tool call), finished or streamed.

The Responses and Messages APIs both present an answer as a list of parts (output items, content blocks);
this is the one place that turns the chat path's ``(reasoning, content, tool_calls)`` into them. A stream
yields ``open`` / ``delta`` / ``close`` events per part, in order, one part open at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from pagedllm.entrypoints.openai.tools import DeltaToolCallItem, ToolCallItem


@dataclass
class Part:
    kind: str  # "reasoning", "text" or "call"
    text: str = ""  # the reasoning or text, or a call's JSON arguments
    call_id: str | None = None
    name: str | None = None


@dataclass
class PartEvent:
    kind: str  # "open", "delta" or "close"
    index: int  # the part's position in the output
    part: Part
    delta: str = ""


def parts_of(content: str | None, tool_calls: Iterable[ToolCallItem], reasoning: str | None = None) -> list[Part]:
    """The parts of a finished choice."""
    parts = ([Part("reasoning", reasoning)] if reasoning else []) + ([Part("text", content)] if content else [])
    return parts + [Part("call", c.function.arguments, c.id, c.function.name) for c in tool_calls]


class PartStream:
    """Streamed chat deltas → :class:`PartEvent`\\ s; ``parts`` holds every part seen so far."""

    def __init__(self) -> None:
        self.parts: list[Part] = []
        self._is_open = False

    def feed(self, content: str | None, tool_calls: list[DeltaToolCallItem] | None,
             reasoning: str | None = None) -> list[PartEvent]:
        events = self._feed_text("reasoning", reasoning) + self._feed_text("text", content)
        for piece in tool_calls or ():
            if piece.id is not None:
                events += self._open(Part("call", call_id=piece.id, name=piece.function.name))
            if piece.function.arguments and self._is_open:
                events.append(self._extend(piece.function.arguments))
        return events

    def _feed_text(self, kind: str, text: str | None) -> list[PartEvent]:
        if not text:
            return []
        events = [] if self._is_open and self.parts[-1].kind == kind else self._open(Part(kind))
        return events + [self._extend(text)]

    def finish(self) -> list[PartEvent]:
        """Close the open part (at the end of the output)."""
        if not self._is_open:
            return []
        self._is_open = False
        return [PartEvent("close", len(self.parts) - 1, self.parts[-1])]

    def _open(self, part: Part) -> list[PartEvent]:
        events = self.finish()
        self.parts.append(part)
        self._is_open = True
        return events + [PartEvent("open", len(self.parts) - 1, part)]

    def _extend(self, text: str) -> PartEvent:
        self.parts[-1].text += text
        return PartEvent("delta", len(self.parts) - 1, self.parts[-1], text)
