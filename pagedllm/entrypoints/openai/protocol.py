"""Pydantic models of the OpenAI API (completions, chat completions, models) plus vLLM's extras.

Requests accept OpenAI's fields and vLLM's extra sampling fields in the body (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``, ...). Unknown fields are
ignored, as OpenAI does. Range checks live in one place, :class:`SamplingParams`
(``to_sampling_params`` raises its ValueError, which the server turns into a 400).

Conventions:

- Lone UTF-16 surrogates (``"\\ud800"``, valid JSON but not valid Unicode text) in any
  string of a request are replaced with U+FFFD before anything else sees them, so such
  a request is served (200) instead of failing in the tokenizer.
- ``max_tokens: null`` (or absent in chat) means "up to the context length":
  ``max_model_len - prompt_tokens``; completions default to 16 as OpenAI does.
- Response floats are finite: a ``-inf`` logprob is reported as ``LOGPROB_FLOOR``
  (-9999.0, as vLLM does), so the JSON never contains ``Infinity`` or ``NaN``.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedllm.sampling_params import RequestOutputKind, SamplingParams

LOGPROB_FLOOR = -9999.0
_SURROGATE = re.compile("[\ud800-\udfff]")


def replace_lone_surrogates(value: Any) -> Any:
    """Recursively replace lone surrogate code points in strings with U+FFFD."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [replace_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {replace_lone_surrogates(k): replace_lone_surrogates(v) for k, v in value.items()}
    return value


def finite_logprob(x: float | None) -> float | None:
    """``x`` as a JSON-safe float: NaN/-inf become LOGPROB_FLOOR, values above 0 become 0."""
    if x is None:
        return None
    if math.isnan(x) or x < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return min(float(x), 0.0)


class OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Request(OpenAIBase):
    """Fields shared by completions and chat requests."""

    @model_validator(mode="before")
    @classmethod
    def _clean_strings(cls, data: Any) -> Any:
        return replace_lone_surrogates(data)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    request_id: str | None = None
    return_tokens_as_token_ids: bool = False

    def _sampling_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            n=self.n, seed=self.seed, stop=self.stop, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.logit_bias:
            kw["logit_bias"] = _parse_logit_bias(self.logit_bias)
        return kw

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def _parse_logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
    return out


class StreamOptions(OpenAIBase):
    include_usage: bool = False


# ---------------------------------------------------------------------------- completions
class CompletionRequest(_Request):
    """``POST /v1/completions``. ``prompt``: a string, strings, token ids, or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True

    @property
    def is_prompt_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: return the prompt (and its logprobs), generate nothing."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams of this request (raises ValueError naming the field)."""
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) when given; got {self.best_of}")
        kw = self._sampling_kwargs()
        kw["max_tokens"] = 1 if self.is_prompt_only else self.max_tokens  # the one token is dropped
        kw["logprobs"] = self.logprobs
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        kw["prompt_logprobs"] = prompt_logprobs
        return SamplingParams(**kw)


class CompletionLogprobs(OpenAIBase):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBase):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptTokensDetails(OpenAIBase):
    cached_tokens: int = 0


class UsageInfo(OpenAIBase):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionResponse(OpenAIBase):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBase):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- chat
class ChatMessage(OpenAIBase):
    """One message. Roles are checked by the engine's chat normalization (clear 400s)."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Accepted so that asking for them gets a clear 400 rather than being silently ignored.
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams of this request (raises ValueError naming the field)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ValueError(f"response_format {self.response_format.get('type')!r} is not supported "
                             "(no guided decoding); only {'type': 'text'}")
        if self.tools:
            raise ValueError("tools (function calling) are not supported by this server")
        if self.tool_choice not in (None, "none"):
            raise ValueError("tool_choice is not supported by this server (no tools)")
        kw = self._sampling_kwargs()
        kw["max_tokens"] = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.logprobs:
            kw["logprobs"] = self.top_logprobs or 0
        return SamplingParams(**kw)

    def conversation(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class ChatTopLogprob(OpenAIBase):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBase):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIBase):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(OpenAIBase):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBase):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBase):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(OpenAIBase):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBase):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- misc endpoints
class ModelCard(OpenAIBase):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBase):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBase):
    """``POST /tokenize``: either ``prompt`` or chat ``messages``."""

    @model_validator(mode="before")
    @classmethod
    def _clean_strings(cls, data: Any) -> Any:
        return replace_lone_surrogates(data)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBase):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(OpenAIBase):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBase):
    prompt: str


class ErrorInfo(OpenAIBase):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBase):
    error: ErrorInfo


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
