"""Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}``, optionally after
``<|python_tag|>``, several separated by ``;`` (the Llama 3.1/3.2/3.3 templates' format,
vLLM's ``llama3_json``). A call starts at the tag or at an object whose first key is
``"name"``; text before it is content.
"""

from __future__ import annotations

import re

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ParsedCall, ParsedOutput, ReparsingToolParser, held_back, json_call, skip_ws)

PYTHON_TAG = "<|python_tag|>"
_START = re.compile(r'<\|python_tag\|>|\{(?=\s*"name"\s*:)')
_PARTIAL_OBJECT = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?')


def _held_object(tail: str) -> str:
    """``tail`` without a last ``{`` that may still become ``{"name":`` (and partial python tag)."""
    tail = held_back(tail, (PYTHON_TAG,), False)
    i = tail.rfind("{")
    return tail[:i] if i >= 0 and _PARTIAL_OBJECT.fullmatch(tail, i) else tail


class Llama3JsonToolParser(ReparsingToolParser):
    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return '"parameters": dictionary of argument name' in chat_template

    def parse(self, text: str, is_final: bool) -> ParsedOutput:
        start = _START.search(text)
        if start is None:
            return ParsedOutput(text if is_final else _held_object(text), [])
        content, calls = text[:start.start()], []
        pos = skip_ws(text, start.end() if start.group() == PYTHON_TAG else start.start())
        while text.startswith("{", pos):
            call, end = json_call(text, pos)
            calls.append(call)
            if end is None:
                return ParsedOutput(content, calls)
            pos = skip_ws(text, end)
            if text.startswith(";", pos):
                pos = skip_ws(text, pos + 1)
        rest = text[pos:]
        return ParsedOutput(content + (rest if is_final or rest.strip() else ""), calls)
