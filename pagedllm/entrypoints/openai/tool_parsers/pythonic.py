"""Pythonic tool calls: a Python list of calls with keyword arguments, ``[f(a=1), g(b="x")]``
(Llama 3.2 and Llama 4, vLLM's ``pythonic``), optionally between ``<|python_start|>`` and
``<|python_end|>``. Parsed with :mod:`ast` (never evaluated); values must be literals. A call
is streamed whole once its closing parenthesis parses; text before the list is content.
"""

from __future__ import annotations

import ast
import json
import re

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedCall, ParsedOutput, ReparsingToolParser, held_back

_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\(")
_PARTIAL_START = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*)?")
_NEXT_NAME = re.compile(r"\s*,?\s*([A-Za-z_][\w.]*)\(")
_MARKERS = re.compile(r"<\|python_(?:start|end)\|>")


def _calls_of(source: str) -> list[ParsedCall] | None:
    """The calls of a complete list expression, or None when it is not a list of keyword-only calls."""
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.List) or not node.elts:
        return None
    calls = []
    for call in node.elts:
        if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        except ValueError:
            return None
        name = ast.unparse(call.func)
        calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False), True, ast.get_source_segment(source, call)))
    return calls


def _list_end(text: str, start: int) -> tuple[list[ParsedCall], int] | None:
    for j in range(start, len(text)):
        if text[j] == "]" and (calls := _calls_of(text[start:j + 1])) is not None:
            return calls, j + 1
    return None


def _open_list(text: str, start: int) -> list[ParsedCall]:
    """The complete calls of a list still open, then the next call (name only) if it has begun."""
    calls: list[ParsedCall] = []
    end = start + 1
    for p in range(len(text) - 1, start, -1):
        if text[p] == ")" and (found := _calls_of(text[start:p + 1] + "]")) is not None:
            calls, end = found, p + 1
            break
    m = _NEXT_NAME.match(text, end)
    if m is not None:
        calls.append(ParsedCall(m.group(1), None, False, text[end:]))
    return calls


class PythonicToolParser(ReparsingToolParser):
    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return "[func_name1(" in chat_template

    def parse(self, text: str, is_final: bool) -> ParsedOutput:
        text = held_back(_MARKERS.sub("", text), ("<|python_start|>", "<|python_end|>"), is_final)
        m = _START.search(text)
        if m is None:
            i = text.rfind("[")
            held = not is_final and i >= 0 and _PARTIAL_START.fullmatch(text, i) is not None
            return ParsedOutput(text[:i] if held else text, [])
        found = _list_end(text, m.start())
        if found is None:
            return ParsedOutput(text[:m.start()], _open_list(text, m.start()))
        calls, end = found
        return ParsedOutput(text[:m.start()] + text[end:], calls)

