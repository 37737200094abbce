"""The tool-parser interface, the plain data it returns (no pydantic, no HTTP) and the
re-parsing base every text format uses.

A format parser writes one function, ``parse(text, is_final)``: the content and the calls
of the text so far, read by the format's structure (a JSON object's end, a call's closing
bracket), never by searching for an end tag. Streaming re-runs it on the text so far and
sends only what is new, so the streamed pieces always concatenate to the whole-output
calls: a call's first piece (id, name) once its name is complete, then its arguments text
as it grows. Content that may be the start of a call is held back until it is decided.
"""

from __future__ import annotations

import json
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
    """Base class. One instance per generated sequence (it holds the streaming state);
    ``tools``: the request's tools (OpenAI shape), for formats whose values need their schemas."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []

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


@dataclass
class ParsedCall:
    """A call as far as the text goes: ``name`` None until complete, ``arguments`` the JSON
    text so far (a prefix of the final text), ``raw`` the call's own text (content when invalid)."""

    name: str | None
    arguments: str | None
    is_complete: bool
    raw: str


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall]


def held_back(text: str, markers: tuple[str, ...], is_final: bool) -> str:
    """``text`` without a suffix that is a proper prefix of one of ``markers`` (kept whole when final)."""
    if is_final:
        return text
    n = max((k for m in markers for k in range(min(len(m) - 1, len(text)), 0, -1) if m.startswith(text[-k:])),
            default=0)
    return text[:len(text) - n]


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


_DECODER = json.JSONDecoder()
ARGUMENTS_KEYS = ("arguments", "parameters")


def json_arguments(text: str, pos: int) -> tuple[str | None, int | None]:
    """The arguments object at ``text[pos]``: ``(raw text, end)``; ``end`` None while it is open
    (then the raw text is all the rest); ``(None, None)`` when no object starts there."""
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return (text[pos:], None) if text.startswith("{", pos) else (None, None)
    return (text[pos:end], end) if isinstance(value, dict) else (None, None)


def json_call(text: str, pos: int) -> tuple[ParsedCall, int | None]:
    """The ``{"name": ..., "arguments"|"parameters": {...}}`` object at ``text[pos]``, walked
    key by key; ``end`` (after its ``}``) None while it is open."""
    name = args = None
    is_args_done = False
    end = None
    i = skip_ws(text, pos + 1)
    while i < len(text):
        if text[i] in ",}":
            if text[i] == "}":
                end = i + 1
                break
            i = skip_ws(text, i + 1)
            continue
        try:
            key, i = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        i = skip_ws(text, i)
        if not text.startswith(":", i) or (i := skip_ws(text, i + 1)) >= len(text):
            break
        if key in ARGUMENTS_KEYS:
            args, j = json_arguments(text, i)
            is_args_done = j is not None
            if j is None:
                break
        else:
            try:
                value, j = _DECODER.raw_decode(text, i)
            except json.JSONDecodeError:
                break
            if key == "name" and isinstance(value, str):
                name = value
        i = skip_ws(text, j)
    is_complete = end is not None and name is not None and is_args_done
    return ParsedCall(name, args, is_complete, text[pos:end]), end


def json_call_array(text: str, pos: int) -> tuple[list[ParsedCall], int | None]:
    """The calls of the JSON array at ``text[pos]`` (``[``), and its end (None while open)."""
    calls: list[ParsedCall] = []
    i = skip_ws(text, pos + 1)
    while text.startswith("{", i):
        call, end = json_call(text, i)
        calls.append(call)
        if end is None:
            return calls, None
        i = skip_ws(text, end)
        if text.startswith(",", i):
            i = skip_ws(text, i + 1)
    return calls, (i + 1 if text.startswith("]", i) else None)


class ReparsingToolParser(ToolParser):
    """A format parser: subclasses write ``parse``; extraction and streaming are shared."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._text = ""
        self._content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[int] = []

    def parse(self, text: str, is_final: bool) -> ParsedOutput:
        raise NotImplementedError

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        parsed = self.parse(text, is_final=True)
        calls = [ToolCall(new_tool_call_id(), c.name, c.arguments) for c in parsed.calls if c.is_complete]
        if not calls:
            return ExtractedToolCalls(content=text or None)
        content = parsed.content + "".join(c.raw for c in parsed.calls if not c.is_complete)
        return ExtractedToolCalls(content=content.strip() or None, tool_calls=calls)

    def extract_streaming(self, delta_text: str, is_final: bool = False) -> StreamDelta:
        self._text += delta_text
        parsed = self.parse(self._text, is_final)
        out = StreamDelta()
        if len(parsed.content) > self._content_sent:
            out.content = parsed.content[self._content_sent:]
            self._content_sent = len(parsed.content)
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break  # later calls cannot have started streaming before this one
            piece = ToolCallDelta(index)
            if index == len(self._ids):
                self._ids.append(new_tool_call_id())
                self._args_sent.append(0)
                piece.id, piece.name, piece.arguments = self._ids[index], call.name, ""
            args = call.arguments or ""
            if len(args) > self._args_sent[index]:
                piece.arguments = (piece.arguments or "") + args[self._args_sent[index]:]
                self._args_sent[index] = len(args)
            if piece.id is not None or piece.arguments:
                out.tool_calls.append(piece)
        return out
