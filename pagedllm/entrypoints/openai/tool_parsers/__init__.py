"""Tool-call parsers, one per model output format (``--tool-call-parser NAME``, vLLM's names, or from the chat
template): a completed output → ``(content, tool_calls)``, and its text deltas → streaming deltas that concatenate
to the same calls."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ToolCallDelta, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

# Detection tries them in this order: Qwen3-Coder's templates also mention <tool_call>.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "qwen3_coder": Qwen3CoderToolParser, "hermes": HermesToolParser, "mistral": MistralToolParser,
    "pythonic": PythonicToolParser, "llama3_json": Llama3JsonToolParser}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``. Raises ValueError listing the known names."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


def detect_tool_parser(chat_template: str | None) -> type[ToolParser] | None:
    """The parser whose format ``chat_template`` teaches the model, or None (no tool format)."""
    for cls in TOOL_PARSERS.values():
        if chat_template and cls.matches_template(chat_template):
            return cls
    return None


__all__ = ["ExtractedToolCalls", "ToolCallDelta", "ToolParser", "TOOL_PARSERS", "get_tool_parser",
           "detect_tool_parser"]
