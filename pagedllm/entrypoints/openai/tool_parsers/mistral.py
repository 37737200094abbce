"""Mistral tool calls after ``[TOOL_CALLS]`` (vLLM's ``mistral``), in either of Mistral's two
formats: a JSON array ``[{"name": ..., "arguments": {...}}, ...]`` (tokenizers before v11), or
``name[ARGS]{...}`` with one ``[TOOL_CALLS]`` per call (v11 and later). Text before is content.
"""

from __future__ import annotations

import re

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ParsedCall, ParsedOutput, ReparsingToolParser, held_back, json_arguments, json_call_array, skip_ws)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _named_call(text: str, pos: int, is_final: bool) -> tuple[ParsedCall | None, int | None]:
    """The ``name[ARGS]{...}`` call at ``pos``; ``(None, None)`` when the text is no such call."""
    m = _NAME.match(text, pos)
    if m is None:
        return (ParsedCall(None, None, False, text[pos:]), None) if pos == len(text) else (None, None)
    i = m.end()
    if not text.startswith(ARGS, i):
        if not is_final and (i == len(text) or ARGS.startswith(text[i:])):
            return ParsedCall(None, None, False, text[pos:]), None
        return None, None
    args, end = json_arguments(text, skip_ws(text, i + len(ARGS)))
    return ParsedCall(m.group(), args, end is not None, text[pos:end]), end


class MistralToolParser(ReparsingToolParser):
    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return TOOL_CALLS in chat_template

    def parse(self, text: str, is_final: bool) -> ParsedOutput:
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while (i := text.find(TOOL_CALLS, pos)) >= 0:
            content.append(text[pos:i])
            j = skip_ws(text, i + len(TOOL_CALLS))
            if text.startswith("[", j):
                found, end = json_call_array(text, j)
            else:
                call, end = _named_call(text, j, is_final)
                found = [call] if call else []
                if call is None:
                    content.append(text[i:j])
                    pos = j
                    continue
            calls.extend(found)
            if end is None:
                return ParsedOutput("".join(content), calls)
            pos = end
        content.append(held_back(text[pos:], (TOOL_CALLS,), is_final))
        return ParsedOutput("".join(content), calls)
