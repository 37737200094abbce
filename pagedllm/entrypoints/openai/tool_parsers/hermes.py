"""Hermes-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (NousResearch's Hermes 2
Pro format, taught by the Qwen 2.5 and 3 templates; vLLM's ``hermes``). Text outside the tags is content. A call
ends where its JSON object ends (a ``</tool_call>`` inside an argument string is text); the end tag after it is
optional, so a call cut off right after its JSON still counts.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ParsedCall, ParsedOutput, ReparsingToolParser, held_back, json_call, skip_ws)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ReparsingToolParser):
    """See the module docstring. ``skip_special_tokens`` must be off for models whose
    ``<tool_call>`` is a special token (the serving layer turns it off)."""

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return START in chat_template

    def parse(self, text: str, is_final: bool) -> ParsedOutput:
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while (i := text.find(START, pos)) >= 0:
            content.append(text[pos:i])
            j = skip_ws(text, i + len(START))
            if j == len(text) or not text.startswith("{", j):
                if j == len(text):
                    calls.append(ParsedCall(None, None, False, text[i:]))
                    return ParsedOutput("".join(content), calls)
                content.append(text[i:j])
                pos = j
                continue
            call, end = json_call(text, j)
            if end is None:
                call.raw = text[i:]
                calls.append(call)
                return ParsedOutput("".join(content), calls)
            k = skip_ws(text, end)
            if text.startswith(END, k):
                k += len(END)
            elif not is_final and END.startswith(text[k:]):
                k = len(text)
            call.raw = text[i:k]
            calls.append(call)
            pos = k
        content.append(held_back(text[pos:], (START,), is_final))
        return ParsedOutput("".join(content), calls)
