"""Qwen3-Coder XML tool calls (vLLM's ``qwen3_coder``)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text up to ``</parameter>`` (one newline trimmed each side),
typed by the tool's schema: ``string`` values stay text, others are read as JSON (as a
string when they are not). Arguments stream one parameter at a time.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ParsedCall, ParsedOutput, ReparsingToolParser, held_back, skip_ws)

TOOL_CALL, FUNCTION, PARAMETER = "<tool_call>", "<function=", "<parameter="
END_PARAMETER, END_FUNCTION, END_TOOL_CALL = "</parameter>", "</function>", "</tool_call>"
_START = re.compile(r"<tool_call>|<function=")


class Qwen3CoderToolParser(ReparsingToolParser):
    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return FUNCTION in chat_template and PARAMETER in chat_template

    def parse(self, text: str, is_final: bool) -> ParsedOutput:
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while (m := _START.search(text, pos)) is not None:
            j = m.end()
            if m.group() == TOOL_CALL:
                j = skip_ws(text, j)
                if not text.startswith(FUNCTION, j):
                    if not is_final and FUNCTION.startswith(text[j:]):
                        break  # the function tag is still arriving
                    content.append(text[pos:j])
                    pos = j
                    continue
                j += len(FUNCTION)
            content.append(text[pos:m.start()])
            call, end = self._call(text, j, m.start(), is_final)
            calls.append(call)
            if end is None:
                return ParsedOutput("".join(content), calls)
            pos = end
        content.append(held_back(text[pos:], (TOOL_CALL, FUNCTION), is_final) if m is None else text[pos:m.start()])
        return ParsedOutput("".join(content), calls)

    def _call(self, text: str, pos: int, start: int, is_final: bool) -> tuple[ParsedCall, int | None]:
        """The call whose name starts at ``pos``, and its end (None while open)."""
        k = text.find(">", pos)
        if k < 0:
            return ParsedCall(None, None, False, text[start:]), None
        name = text[pos:k]
        items: list[str] = []
        i = skip_ws(text, k + 1)
        while text.startswith(PARAMETER, i):
            k = text.find(">", i)
            close = text.find(END_PARAMETER, k) if k >= 0 else -1
            if close < 0:
                break
            key = text[i + len(PARAMETER):k]
            items.append(f"{json.dumps(key, ensure_ascii=False)}: "
                         f"{json.dumps(self._value(name, key, text[k + 1:close]), ensure_ascii=False)}")
            i = skip_ws(text, close + len(END_PARAMETER))
        if not text.startswith(END_FUNCTION, i):
            return ParsedCall(name, "{" + ", ".join(items), False, text[start:]), None
        end = skip_ws(text, i + len(END_FUNCTION))
        if text.startswith(END_TOOL_CALL, end):
            end += len(END_TOOL_CALL)
        elif is_final or not END_TOOL_CALL.startswith(text[end:]):
            end = i + len(END_FUNCTION)
        else:
            end = len(text)  # the closing tag is still arriving
        return ParsedCall(name, "{" + ", ".join(items) + "}", True, text[start:end]), end

    def _value(self, function: str, key: str, raw: str) -> Any:
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        if self._type(function, key) in ("string", None):
            return raw
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw

    def _type(self, function: str, key: str) -> str | None:
        for tool in self.tools:
            fn = tool.get("function", {})
            if fn.get("name") == function:
                prop = (fn.get("parameters") or {}).get("properties", {}).get(key, {})
                return prop.get("type") if isinstance(prop.get("type"), str) else None
        return None
