"""Pydantic models of OpenAI's Responses API (``POST /v1/responses``): the request, the response
object, its output items and its usage. What each field does is in ``docs/api.md``."""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, StrictBool

from pagedllm.entrypoints.openai.protocol import NonEmptyStr, OpenAIBase, _RequestBase


class ResponsesRequest(_RequestBase):
    """``POST /v1/responses``."""

    model: str | None = None
    input: NonEmptyStr | Annotated[list[dict[str, Any]], Field(min_length=1)] | None = Field(
        None, description="A user message, or a list of items: messages (text parts), function_call, "
                          "function_call_output, reasoning (skipped). Needed unless previous_response_id is given.")
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float | None = Field(None, ge=0, le=2, strict=True)
    top_p: float | None = Field(None, gt=0, le=1, strict=True)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    store: StrictBool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    cache_salt: NonEmptyStr | None = None  # vLLM's prefix-cache namespace (docs/robustness.md)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching needs no key
    reasoning: dict[str, Any] | None = None  # effort: the template's reasoning_effort (as chat); summary: no effect
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, strict=True)
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: dict[str, Any] | None = None
    service_tier: str | None = None

    # refused field -> the values that mean "off" (400 naming the field otherwise)
    _REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "background": (False,), "top_logprobs": (0,), "max_tool_calls": (), "conversation": (), "prompt": (),
        "truncation": ("disabled",)}


class OutputText(OpenAIBase):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIBase):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(OpenAIBase):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(OpenAIBase):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBase):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(OpenAIBase):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBase):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBase):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBase):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(OpenAIBase):
    code: str
    message: str


class ResponseObject(OpenAIBase):
    id: str
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=time.time)
    model: str
    status: Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
    output: list[ReasoningItem | OutputMessage | FunctionCallItem] = Field(default_factory=list)
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    store: bool = True
    background: bool = False
    usage: ResponseUsage | None = None
