"""The tool-parser interface and the plain data it returns (no pydantic, no HTTP)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def new_tool_call_id() -> str:
    """An OpenAI-style tool call id (``call_`` + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One complete call: ``arguments`` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str


@dataclass
class ExtractedToolCalls:
    """A completed output split into free text (``content``, None when empty) and calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """One streamed piece of call ``index``: the first piece carries ``id`` and ``name``;
    ``arguments`` pieces concatenate to the call's full arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class StreamDelta:
    """What one text delta of the output becomes: content and/or call pieces."""

    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser:
    """Base class. One instance per generated sequence (it holds the streaming state)."""

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        """Whether ``chat_template`` teaches this parser's format."""
        raise NotImplementedError

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """Split a completed output into content and calls."""
        raise NotImplementedError

    def extract_streaming(self, delta_text: str, is_final: bool = False) -> StreamDelta:
        """The streamed pieces for the next ``delta_text`` of the output (``is_final``: no more text follows)."""
        raise NotImplementedError
