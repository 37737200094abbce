"""Hermes-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (NousResearch's Hermes 2
Pro format, taught by the Qwen 2.5 and 3 templates; vLLM's ``hermes``). Text outside the tags is content; a call
left open at the end counts if its JSON is complete. Streaming re-parses the text so far with the whole-output
function and sends only what is new (the name once complete, then the raw arguments text as it grows), so the
pieces concatenate to the non-streamed call; a possible start of ``<tool_call>`` is held back until decided.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls, StreamDelta, ToolCall, ToolCallDelta, ToolParser, new_tool_call_id)

START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


@dataclass
class _ParsedCall:
    name: str | None  # None until the name string is complete
    arguments: str | None  # raw JSON text of the arguments so far (None before it starts)
    is_complete: bool  # closed and valid: a name and a whole arguments object
    raw: str  # the whole tag, for falling back to content when the call is invalid


@dataclass
class _Parsed:
    content: str
    calls: list[_ParsedCall]


def _parse_body(body: str, is_closed: bool, raw: str) -> _ParsedCall:
    key = _ARGS_KEY.search(body)
    name_match = _NAME.search(body, 0, key.start() if key else len(body))
    name = json.loads(f'"{name_match.group(1)}"') if name_match else None
    arguments = None
    is_args_complete = False
    if key is not None:
        start = key.end()
        rest = body[start:]
        if rest.strip():
            start += len(rest) - len(rest.lstrip())
            try:
                value, end = _DECODER.raw_decode(body, start)
                arguments, is_args_complete = body[start:end], isinstance(value, dict)
            except json.JSONDecodeError:
                arguments = body[start:]
            if not arguments.startswith("{"):
                arguments = None
    is_complete = False
    if is_closed and name is not None and is_args_complete:
        try:
            is_complete = isinstance(json.loads(body), dict)
        except json.JSONDecodeError:
            pass
    return _ParsedCall(name, arguments, is_complete, raw)


def _partial_start(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


def _parse(text: str, is_final: bool) -> _Parsed:
    content: list[str] = []
    calls: list[_ParsedCall] = []
    pos = 0
    while True:
        i = text.find(START, pos)
        if i < 0:
            tail = text[pos:]
            content.append(tail if is_final else tail[:len(tail) - _partial_start(tail)])
            break
        content.append(text[pos:i])
        body_start = i + len(START)
        j = text.find(END, body_start)
        if j < 0:
            calls.append(_parse_body(text[body_start:], is_final, text[i:]))
            break
        calls.append(_parse_body(text[body_start:j], True, text[i:j + len(END)]))
        pos = j + len(END)
    return _Parsed("".join(content), calls)


class HermesToolParser(ToolParser):
    """See the module docstring. ``skip_special_tokens`` must be off for models whose
    ``<tool_call>`` is a special token (the serving layer turns it off)."""

    def __init__(self) -> None:
        self._text = ""
        self._content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[int] = []

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return START in chat_template

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        parsed = _parse(text, is_final=True)
        calls = [ToolCall(new_tool_call_id(), c.name, c.arguments) for c in parsed.calls if c.is_complete]
        if not calls:
            return ExtractedToolCalls(content=text or None)
        content = parsed.content + "".join(c.raw for c in parsed.calls if not c.is_complete)
        return ExtractedToolCalls(content=content.strip() or None, tool_calls=calls)

    def extract_streaming(self, delta_text: str, is_final: bool = False) -> StreamDelta:
        self._text += delta_text
        parsed = _parse(self._text, is_final)
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
