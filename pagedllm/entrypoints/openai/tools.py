"""Tool calling on the chat path: ``tools``, ``tool_choice``, ``message.tool_calls``.

``tool_choice`` (default ``"auto"`` with tools, as OpenAI): ``"none"`` plain text; ``"auto"`` unconstrained, the
model's tool-call parser (``--tool-call-parser``, else the chat template's) finds the calls, 400 without one (as
vLLM); ``"required"`` the output is constrained to a JSON array of ``{"name", "parameters"}`` calls (one with
``parallel_tool_calls: false``); a named function: constrained to its parameters (``finish_reason`` stays
``"stop"``, as OpenAI). Streamed calls: the first piece has ``id`` and ``name``, argument pieces concatenate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.structured_outputs import check_constraint
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, detect_tool_parser, get_tool_parser
from pagedllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls, ParsedOutput, ReparsingToolParser, StreamDelta, ToolCall, ToolCallDelta, ToolParser,
    json_call_array, new_tool_call_id, skip_ws)
from pagedllm.sampling_params import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# ---------------------------------------------------------------------------- protocol models
class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallItem(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCallItem(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


def tool_call_items(calls: list[ToolCall]) -> list[ToolCallItem]:
    return [ToolCallItem(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def delta_tool_call_items(pieces: list[ToolCallDelta]) -> list[DeltaToolCallItem] | None:
    if not pieces:
        return None
    return [DeltaToolCallItem(index=p.index, id=p.id, type="function" if p.id else None,
                              function=DeltaFunctionCall(name=p.name, arguments=p.arguments)) for p in pieces]


# ---------------------------------------------------------------------------- the plan
@dataclass
class ToolPlan:
    """What a request's ``tools``/``tool_choice`` decide.

    ``tools``: the validated tools for the chat template; ``mode``: none, auto, required
    or named; ``constraint``: the output constraint (required, named); ``parser_cls``:
    the tool-call parser (auto); ``function``: the forced function's name (named).
    """

    tools: list[dict[str, Any]]
    mode: str
    constraint: StructuredOutputsParams | None = None
    parser_cls: type[ToolParser] | None = None
    function: str | None = None

    @property
    def parses_output(self) -> bool:
        return self.mode != "none"

    def new_parser(self) -> ToolParser:
        """A fresh per-sequence parser of the output (one per choice, it holds streaming state)."""
        if self.mode == "named":
            return NamedToolCall(self.function)
        if self.mode == "required":
            return RequiredToolCalls()
        return self.parser_cls(self.tools)

    def finish_reason(self, finish_reason: str | None, has_calls: bool) -> str | None:
        """OpenAI's finish_reason: ``tool_calls`` when auto/required produced calls and the output ended normally."""
        if has_calls and finish_reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return finish_reason


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               parser_name: str | None, chat_template: str | None) -> ToolPlan | None:
    """Validate ``tools`` and ``tool_choice``; None when the request has neither.

    Raises APIError(400) naming ``tools`` (not a list, a tool without a function name, a
    name outside ``[A-Za-z0-9_-]{1,64}``, duplicate names, a parameters schema that does
    not compile) or ``tool_choice`` (unknown value, a function not in ``tools``, a choice
    without tools, ``auto`` without a tool-call parser).
    """
    if isinstance(tool_choice, BaseModel):  # the protocol's NamedToolChoice
        tool_choice = tool_choice.model_dump()
    if not tools:
        if tool_choice in (None, "none"):
            return None
        raise APIError(400, f"tool_choice {tool_choice!r} requires tools", "tool_choice")
    checked = [_check_tool(i, t) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise APIError(400, f"tools must have distinct function names, got {names}", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if name not in names:
            raise APIError(400, f"tool_choice names function {name!r}, which is not in tools ({', '.join(names)})",
                           "tool_choice")
        schema = _parameters(checked[names.index(name)])
        return ToolPlan(checked, "named", StructuredOutputsParams(json=schema), function=name)
    if choice == "none":
        return ToolPlan(checked, "none")
    if choice == "required":
        return ToolPlan(checked, "required", _required_constraint(checked, parallel_tool_calls is not False))
    if choice == "auto":
        parser_cls = get_tool_parser(parser_name) if parser_name else detect_tool_parser(chat_template)
        if parser_cls is None:
            raise APIError(400, "tool_choice 'auto' needs a tool-call parser for this model: start the server "
                                f"with --tool-call-parser NAME (known: {', '.join(sorted(TOOL_PARSERS))}), or "
                                "use tool_choice 'required' or a named function", "tool_choice")
        return ToolPlan(checked, "auto", parser_cls=parser_cls)
    raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                   "tool_choice")


def _check_tool(i: int, tool: Any) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
        raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise APIError(400, f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                       "tools")
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        check_constraint(StructuredOutputsParams(json=params), f"tools[{i}].function.parameters")
    return {"type": "function", "function": fn}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _required_constraint(tools: list[dict[str, Any]], is_parallel: bool) -> StructuredOutputsParams:
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not is_parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


# ---------------------------------------------------------------------------- constrained outputs
class NamedToolCall(ToolParser):
    """The output *is* the arguments of the forced function (constrained to its schema)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._id: str | None = None

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        return ExtractedToolCalls(None, [ToolCall(new_tool_call_id(), self.name, text)])

    def extract_streaming(self, delta_text: str, is_final: bool = False) -> StreamDelta:
        if self._id is None:
            self._id = new_tool_call_id()
            return StreamDelta(tool_calls=[ToolCallDelta(0, self._id, self.name, delta_text)])
        return StreamDelta(tool_calls=[ToolCallDelta(0, arguments=delta_text)] if delta_text else [])


class RequiredToolCalls(ReparsingToolParser):
    """The output is a JSON array of ``{"name", "parameters"}`` (constrained); each element is
    one call, streamed as it is generated (the raw parameters text). A cut output keeps every
    call whose name is complete, its arguments as far as they got."""

    def parse(self, text: str, is_final: bool) -> ParsedOutput:
        start = skip_ws(text, 0)
        return ParsedOutput("", json_call_array(text, start)[0] if text.startswith("[", start) else [])

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        calls = self.parse(text, True).calls
        return ExtractedToolCalls(None, [ToolCall(new_tool_call_id(), c.name, c.arguments or "")
                                         for c in calls if c.name is not None])


# ---------------------------------------------------------------------------- serving helpers
def apply_tool_plan(plan: ToolPlan | None, params) -> None:
    """Put the plan's output constraint on ``params`` (SamplingParams), and keep special
    tokens in the text a tool-call parser reads (``<tool_call>`` is one in Qwen's vocabulary).

    Raises APIError(400) when the request also carries another output constraint.
    """
    if plan is None:
        return
    if plan.constraint is not None:
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice {plan.mode!r} constrains the output itself and cannot be combined "
                                "with response_format or structured_outputs", "tool_choice")
        params.structured_outputs = plan.constraint
    if plan.mode == "auto":
        params.skip_special_tokens = False


def message_parts(plan: ToolPlan | None, text: str, finish_reason: str | None
                  ) -> tuple[str | None, list[ToolCallItem], str | None]:
    """``(content, tool_calls, finish_reason)`` of a finished choice."""
    if plan is None or not plan.parses_output:
        return text, [], finish_reason
    extracted = plan.new_parser().extract_tool_calls(text)
    calls = tool_call_items(extracted.tool_calls)
    return extracted.content, calls, plan.finish_reason(finish_reason, bool(calls))


class ToolStream:
    """Per-choice streaming state: text deltas → ``(content, delta.tool_calls, finish_reason)``."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self.plan = plan if plan is not None and plan.parses_output else None
        self._parsers: dict[int, ToolParser] = {}
        self._has_calls: set[int] = set()

    def delta(self, index: int, text: str, finish_reason: str | None
              ) -> tuple[str | None, list[DeltaToolCallItem] | None, str | None]:
        if self.plan is None:
            return text, None, finish_reason
        parser = self._parsers.setdefault(index, self.plan.new_parser())
        piece = parser.extract_streaming(text, is_final=finish_reason is not None)
        if piece.tool_calls:
            self._has_calls.add(index)
        return (piece.content, delta_tool_call_items(piece.tool_calls),
                self.plan.finish_reason(finish_reason, index in self._has_calls))
