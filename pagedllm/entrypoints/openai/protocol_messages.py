"""Pydantic models of Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``):
requests, the message, its content blocks, usage and the error body. Field notes are in ``docs/api.md``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool

from pagedllm.entrypoints.openai.protocol import NonEmptyStr, OpenAIBase, _RequestBase


class AnthropicMessage(OpenAIBase):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class _Conversation(_RequestBase):
    model: str | None = None
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # enabled or adaptive: the reasoning comes back as a thinking block


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``."""


class MessagesRequest(_Conversation):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1, strict=True)
    stop_sequences: list[NonEmptyStr] | None = None
    temperature: float | None = Field(None, ge=0, le=1, strict=True)
    top_p: float | None = Field(None, gt=0, le=1, strict=True)
    top_k: int | None = Field(None, ge=1, strict=True)
    metadata: dict[str, Any] | None = None
    cache_salt: NonEmptyStr | None = None  # vLLM's prefix-cache namespace (docs/robustness.md)
    output_config: dict[str, Any] | None = None
    stream: StrictBool = False
    service_tier: str | None = None


class CountTokensResponse(OpenAIBase):
    input_tokens: int


class TextBlock(OpenAIBase):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(OpenAIBase):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing signs a local model's reasoning


class ToolUseBlock(OpenAIBase):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(OpenAIBase):
    input_tokens: int  # prompt tokens not read from the cache, as Anthropic counts them
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessagesResponse(OpenAIBase):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicErrorDetail(OpenAIBase):
    type: str
    message: str


class AnthropicErrorResponse(OpenAIBase):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
