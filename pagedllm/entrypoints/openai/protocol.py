"""Pydantic models of the OpenAI API (completions, chat, tokenize, models) plus vLLM's extra fields.

Every field is honoured or refused with a 400 naming it; unknown fields are ignored and
logged once per name. Constraints that one field can state are in the models (so the
OpenAPI document states them); cross-field rules and ranges live in
:class:`SamplingParams` and ``to_sampling_params``. Conventions (lone surrogates,
``max_tokens: null``, finite logprobs) are listed in ``docs/architecture.md``.
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_serializer, model_validator

from pagedllm.entrypoints.openai.structured_outputs import structured_outputs_of
from pagedllm.entrypoints.openai.tools import DeltaToolCallItem, ToolCallItem
from pagedllm.sampling_params import MAX_PROMPTS, RequestOutputKind, SamplingParams, sampling_field_names

logger = logging.getLogger("pagedllm.server")

LOGPROB_FLOOR = -9999.0
_SURROGATE = re.compile("[\ud800-\udfff]")


def normalize_json_values(value: Any) -> Any:
    """A request body's JSON values as the server reads them, recursively.

    Lone surrogate code points in strings become U+FFFD. A number without a fractional part
    (``16.0``, ``1e3``) becomes that integer: JSON has one number type, JSON Schema's
    ``integer`` includes ``1.0`` (so the OpenAPI document allows it) and JavaScript clients
    cannot tell ``16.0`` from ``16``; ``1.5``, ``true`` and ``"16"`` stay what they are, and
    integer fields refuse them.
    """
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, list):
        return [normalize_json_values(v) for v in value]
    if isinstance(value, dict):
        return {normalize_json_values(k): normalize_json_values(v) for k, v in value.items()}
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


# Rules JSON Schema cannot state (they span fields or depend on the model), in the fields'
# descriptions; the server answers each broken rule with a 400 naming the field.
# openapi.finish_document writes the server's numbers in place of {max_model_len} and {vocab_size}.
_CONTEXT_RULE = ("The prompt's tokens plus `max_tokens` must fit in the model's context, max_model_len "
                "({max_model_len} tokens, also in `GET /v1/models`), with room for at least one output "
                "token; otherwise 400 naming `{field}`.")
_LOGIT_BIAS_RULE = ("Token id (a decimal string) -> bias added to its logit before sampling. Each id must be "
                    "below the vocabulary size ({vocab_size}); otherwise 400 naming `logit_bias`.")
_MIN_TOKENS_RULE = ("Tokens to generate before EOS or a stop token may end the output. At most the request's "
                    "`max_tokens` (`max_completion_tokens` in chat) when that is given; otherwise 400 naming "
                    "`min_tokens`.")
_MAX_TOKENS_RULE = ("Most tokens to generate. The prompt plus this must fit in max_model_len ({max_model_len} "
                    "tokens): otherwise 400 naming `{field}`.")

# A token id: strict, as a JSON boolean is not one. TOKEN_ID_MARK tells the OpenAPI document where
# to state the vocabulary's last id as the maximum (openapi.finish_document).
TOKEN_ID_MARK = "x-pagedllm-token-id"
TokenId = Annotated[int, Field(ge=0, strict=True, json_schema_extra={TOKEN_ID_MARK: True})]
# Boolean fields are StrictBool for the same reason the other way round: OpenAI answers 400 to
# `"stream": 0` or `"echo": "true"`, and the OpenAPI document says boolean. Numeric request fields
# are strict too (`"max_tokens": "16"`, `"frequency_penalty": false` → 400); a float field takes
# a JSON integer, an integer field an integral number (`16.0`: normalize_json_values).
NonEmptyStr = Annotated[str, Field(min_length=1)]
_warned_fields: set[str] = set()


def warn_unknown_fields(model: type[BaseModel], data: Any) -> None:
    """Log each request field the server does not know once, at WARNING (as vLLM does); it is ignored."""
    if not isinstance(data, dict):
        return
    for name in sorted(set(data) - set(model.model_fields) - _warned_fields):
        _warned_fields.add(name)
        logger.warning("ignoring unknown request field %r (logged once per field name)", name)


def only_with(field: str, other: str, value: Any, required: bool = True) -> dict[str, Any]:
    """A JSON Schema rule: ``field``, when given (not null), needs ``other`` to be ``value``
    (``required``: given explicitly, as ``other``'s default is not ``value``)."""
    then: dict[str, Any] = {"properties": {other: {"const": value}}}
    if required:
        then["required"] = [other]
    return {"if": {"properties": {field: {"not": {"type": "null"}}}, "required": [field]}, "then": then}


class _RequestBase(OpenAIBase):
    """Any request body: values normalized (:func:`normalize_json_values`), unknown fields
    logged once and ignored.

    The OpenAPI document states what the server checks across fields where JSON Schema can
    (``_RULES``, as ``allOf``), and a refused field's only accepted values (``_REFUSED``)."""

    _RULES: ClassVar[tuple[dict[str, Any], ...]] = ()
    _REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, data: Any) -> Any:
        warn_unknown_fields(cls, data)
        return normalize_json_values(data)

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        schema = handler.resolve_ref_schema(handler(core_schema))
        for name, off_values in cls._REFUSED.items():  # its off values, and null where the field takes it
            takes_null = cls.model_fields[name].default is None
            schema["properties"][name]["enum"] = [*off_values, *([None] if takes_null else [])]
        if cls._RULES:
            schema["allOf"] = list(cls._RULES)
        return schema


class ToolChoiceFunction(OpenAIBase):
    name: str


class NamedToolChoice(OpenAIBase):
    type: Literal["function"]
    function: ToolChoiceFunction


class ResponseFormat(OpenAIBase):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _Request(_RequestBase):
    """Fields shared by completions and chat requests (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, strict=True)
    temperature: float | None = Field(None, ge=0, strict=True)
    top_p: float | None = Field(None, gt=0, le=1, strict=True)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    cache_salt: NonEmptyStr | None = None
    stream: StrictBool = False
    stream_options: "StreamOptions | None" = None
    seed: int | None = Field(None, ge=-(2**63 - 1), le=2**63 - 1, strict=True)
    presence_penalty: float | None = Field(None, ge=-2, le=2, strict=True)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, strict=True)
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]+$")],
                     Annotated[float, Field(ge=-100, le=100, strict=True)]] | None = Field(
        None, description=_LOGIT_BIAS_RULE)
    user: str | None = None  # a label: shown in the request's log line
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1, strict=True)
    min_p: float | None = Field(None, ge=0, le=1, strict=True)
    repetition_penalty: float | None = Field(None, gt=0, strict=True)
    min_tokens: int = Field(0, ge=0, strict=True, description=_MIN_TOKENS_RULE)
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: list[NonEmptyStr] | None = None
    priority: int = Field(0, strict=True)
    request_id: str | None = None
    return_tokens_as_token_ids: StrictBool = False
    # The last N prompt tokens (-1: as many as fit); its maximum (max_model_len) is stated by the document.
    truncate_prompt_tokens: int | None = Field(None, ge=-1, strict=True, json_schema_extra={"not": {"const": 0}})
    # Output constraints: translated and validated by structured_outputs.py (400 naming the field).
    response_format: ResponseFormat | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def _check_fields(self) -> None:
        """Refuse what cannot be honoured (ValueError naming the field)."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        for name, off_values in self._REFUSED.items():
            value = getattr(self, name)
            if value is not None and value not in off_values:
                raise ValueError(f"{name} is not supported by this server; got {value!r}")

    # Fields of the OpenAI / vLLM APIs this server does not implement -> the values that mean "off".
    _REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    # Sampling fields whose meaning differs from SamplingParams': each request sets them itself.
    _OWN_SAMPLING_FIELDS: ClassVar[tuple[str, ...]] = ("max_tokens", "logprobs", "prompt_logprobs")

    def _sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields this request sets, by name (None = SamplingParams' default)."""
        kw: dict[str, Any] = {name: getattr(self, name) for name in sampling_field_names()
                              if name in type(self).model_fields and name not in self._OWN_SAMPLING_FIELDS
                              and getattr(self, name) is not None}
        kw["output_kind"] = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        kw["structured_outputs"] = structured_outputs_of(self)  # APIError(400) naming the field
        return kw

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def include_usage_in_every_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)


class StreamOptions(OpenAIBase):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # usage in every chunk (vLLM's)


# The cross-field rules of to_sampling_params (and /tokenize) that JSON Schema can state.
_STREAM_OPTIONS_NEED_STREAM = only_with("stream_options", "stream", True)
_PROMPT_LOGPROBS_NOT_STREAMED = only_with("prompt_logprobs", "stream", False, required=False)
_TOP_LOGPROBS_NEED_LOGPROBS = only_with("top_logprobs", "logprobs", True)
_CONTINUE_WITHOUT_GENERATION_PROMPT = {  # only_with for a boolean: "given" is "true"
    "if": {"properties": {"continue_final_message": {"const": True}}, "required": ["continue_final_message"]},
    "then": {"properties": {"add_generation_prompt": {"const": False}}, "required": ["add_generation_prompt"]}}


_RENDER_ARGUMENTS = {"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                     "continue_final_message", "tokenize", "return_dict"}


class _ChatTemplateFlags(BaseModel):
    """How a conversation is rendered (chat and ``/tokenize``): ``continue_final_message`` leaves
    the last (assistant) message open for the model to continue, so no generation prompt may
    follow it; both true is refused (vLLM's rule; _CONTINUE_WITHOUT_GENERATION_PROMPT in the document)."""

    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    def template_kwargs(self, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """The template's extra variables: ``defaults`` (the server's), then ``chat_template_kwargs``,
        then ``reasoning_effort``. Raises ValueError naming ``chat_template_kwargs`` for a key the
        server sets itself."""
        kwargs = {**(defaults or {}), **(self.chat_template_kwargs or {})}
        reserved = sorted(set(kwargs) & _RENDER_ARGUMENTS)
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}: the request's own fields do")
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs

    def check_template_flags(self) -> None:
        """Raise ValueError naming ``continue_final_message`` when both flags are true."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                             "(add_generation_prompt defaults to true: send false with continue_final_message)")


# ---------------------------------------------------------------------------- completions
class CompletionRequest(_Request):
    """``POST /v1/completions``. ``prompt``: a string, strings, token ids, or lists of token ids."""

    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)]) = Field(
        description=_CONTEXT_RULE.replace("{field}", "prompt") + " With several prompts, each must fit.")
    max_tokens: int | None = Field(16, ge=0, strict=True,
                                   description=_MAX_TOKENS_RULE.replace("{field}", "prompt")
                                   + " 0 only with `echo`: the prompt alone, scored.")
    logprobs: int | None = Field(None, ge=0, strict=True)
    echo: StrictBool = False
    best_of: int | None = Field(None, ge=1, strict=True, description=(
        "Must equal `n` when given: vLLM requires best_of >= n, and this server does no best-of "
        "selection, so it generates `n` completions and accepts only best_of == n; otherwise 400 naming "
        "`best_of`."))
    prompt_logprobs: int | None = Field(None, ge=0, strict=True)
    add_special_tokens: StrictBool = True
    suffix: str | None = None
    use_beam_search: StrictBool | None = None
    length_penalty: float | None = Field(None, strict=True)

    _REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {"suffix": ("",), "use_beam_search": (False,), "length_penalty": (1.0,)}
    _RULES: ClassVar[tuple[dict[str, Any], ...]] = (_STREAM_OPTIONS_NEED_STREAM, _PROMPT_LOGPROBS_NOT_STREAMED)

    @property
    def is_prompt_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: return the prompt (and its logprobs), generate nothing."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams of this request (raises ValueError naming the field)."""
        self._check_fields()
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) when given (no best-of selection); got {self.best_of}")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available when stream is true")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 only with echo (the prompt alone, scored); otherwise it must be >= 1")
        kw = self._sampling_kwargs()
        kw["max_tokens"] = 1 if self.is_prompt_only else self.max_tokens  # the one token is dropped
        kw["logprobs"] = self.logprobs
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        kw["prompt_logprobs"] = prompt_logprobs
        return SamplingParams(**kw)


class LogprobInfo(OpenAIBase):
    """One token's entry in ``prompt_logprobs`` (vLLM's shape)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token: None for the first, then {token id (as a string key): LogprobInfo}.
PromptLogprobs = list[dict[str, LogprobInfo] | None]


def make_prompt_logprobs(entries: list | None, decode: Any) -> PromptLogprobs | None:
    """``RequestOutput.prompt_logprobs`` as the response field (``decode(token_id) -> text``)."""
    if entries is None:
        return None
    return [None if e is None else {str(t): LogprobInfo(logprob=finite_logprob(l.logprob), rank=l.rank,
                                                        decoded_token=decode(t)) for t, l in e.items()}
            for e in entries]


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
    prompt_logprobs: PromptLogprobs | None = None


class PromptTokensDetails(OpenAIBase):
    cached_tokens: int = 0


class UsageMetrics(OpenAIBase):
    """pagedllm's per-request story in ``usage.metrics`` (an extension of OpenAI's usage):
    cached prompt tokens by tier (``pool``, ``host``, ``disk``; they sum to
    ``prompt_tokens_details.cached_tokens``), preemptions and their modes, and the
    request's queue, prefill and decode time in seconds (the longest over the prompts of
    a multi-prompt completion; null when not reached)."""

    cached_tokens_by_tier: dict[str, int] = Field(default_factory=dict)
    num_preemptions: int = 0
    preemption_modes: list[str] = Field(default_factory=list)
    queue_time: float | None = None
    prefill_time: float | None = None
    decode_time: float | None = None
    # speculative decoding: draft tokens verified and accepted (left out when none were drafted)
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None

    @model_serializer(mode="wrap")
    def _drop_no_speculation(self, handler):
        data = handler(self)
        for name in ("num_draft_tokens", "num_accepted_tokens"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class CompletionTokensDetails(OpenAIBase):
    reasoning_tokens: int = 0


class UsageInfo(OpenAIBase):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None
    metrics: UsageMetrics | None = None

    @model_serializer(mode="wrap")
    def _drop_no_details(self, handler):
        data = handler(self)
        if data.get("completion_tokens_details") is None:
            data.pop("completion_tokens_details", None)
        return data


def _longest(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(max(known), 6) if known else None


def usage_metrics(metrics: list) -> UsageMetrics:
    """The usage story of one or more requests' ``RequestMetrics`` (counts summed, times the longest)."""
    tiers: dict[str, int] = {}
    for m in metrics:
        for tier, n in (m.cached_tokens_by_tier or {}).items():
            tiers[tier] = tiers.get(tier, 0) + n
    return UsageMetrics(cached_tokens_by_tier=tiers, num_preemptions=sum(m.num_preemptions for m in metrics),
                        preemption_modes=[x for m in metrics for x in m.preemption_modes],
                        queue_time=_longest([m.queue_time for m in metrics]),
                        prefill_time=_longest([m.prefill_time for m in metrics]),
                        decode_time=_longest([m.decode_time for m in metrics]),
                        **_spec_decode_counts(metrics))


def _spec_decode_counts(metrics: list) -> dict:
    drafted = sum(getattr(m, "num_draft_tokens", 0) for m in metrics)
    if not drafted:
        return {}
    return {"num_draft_tokens": drafted, "num_accepted_tokens": sum(m.num_accepted_tokens for m in metrics)}


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None, metrics: list | None = None
               ) -> UsageInfo:
    """OpenAI's usage; ``metrics`` (the requests' ``RequestMetrics``) adds ``usage.metrics``.
    ``cached_tokens`` None leaves every cached-token count out (``prompt_tokens_details``, by tier)."""
    story = usage_metrics(metrics) if metrics else None
    if story is not None and cached_tokens is None:
        story.cached_tokens_by_tier = {}
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     metrics=story, prompt_tokens_details=None if cached_tokens is None
                     else PromptTokensDetails(cached_tokens=cached_tokens))


class _Envelope(OpenAIBase):
    """The fields every completion and chat response (and chunk) opens with, in OpenAI's order."""
    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- chat
class TextPart(OpenAIBase):
    """A content part: text only (images and audio are not supported)."""

    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBase):
    """One message (the roles the chat normalization knows; the rest is checked there, with clear 400s)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers


class ChatCompletionRequest(_Request, _ChatTemplateFlags):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)] = Field(
        description="The conversation, rendered by the chat template. " + _CONTEXT_RULE.replace("{field}", "messages"))
    max_tokens: int | None = Field(None, ge=1, strict=True, description=(
        "Deprecated by OpenAI for `max_completion_tokens`, which wins when both are given. "
        + _MAX_TOKENS_RULE.replace("{field}", "messages") + " Default: what is left of max_model_len."))
    max_completion_tokens: int | None = Field(None, ge=1, strict=True, description=(
        _MAX_TOKENS_RULE.replace("{field}", "messages") + " Default: what is left of max_model_len."))
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, strict=True)
    prompt_logprobs: int | None = Field(None, ge=0, strict=True)
    chat_template: str | None = None
    # Tools: validated and planned by tools.py (the template receives them).
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # no effect without tools
    echo: StrictBool = False
    store: StrictBool | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    use_beam_search: StrictBool | None = None
    best_of: int | None = None
    length_penalty: float | None = None

    _REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "echo": (False,), "store": (False,), "audio": (), "modalities": (["text"],), "prediction": (),
        "documents": ([],), "use_beam_search": (False,), "best_of": (1,), "length_penalty": (1.0,)}
    _RULES: ClassVar[tuple[dict[str, Any], ...]] = (_STREAM_OPTIONS_NEED_STREAM, _PROMPT_LOGPROBS_NOT_STREAMED,
                                                    _TOP_LOGPROBS_NEED_LOGPROBS, _CONTINUE_WITHOUT_GENERATION_PROMPT)

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams of this request (raises ValueError naming the field)."""
        self._check_fields()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        self.check_template_flags()
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available when stream is true")
        kw = self._sampling_kwargs()
        kw["max_tokens"] = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.logprobs:
            kw["logprobs"] = self.top_logprobs or 0
        kw["prompt_logprobs"] = self.prompt_logprobs
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


class _OmitsNoToolCalls(OpenAIBase):
    """A message whose ``tool_calls`` key is left out when there are none (OpenAI's shape), and its
    reasoning keys when it has no reasoning."""

    @model_serializer(mode="wrap")
    def _drop_empty_tool_calls(self, handler):
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        for key in ("reasoning_content", "reasoning"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatResponseMessage(_OmitsNoToolCalls):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the model's reasoning (a reasoning parser's split); also as `reasoning`
    reasoning: str | None = None
    tool_calls: list[ToolCallItem] = Field(default_factory=list)


class _ChatChoiceBase(OpenAIBase):
    """What a chat choice and a streamed chat choice share (``message`` or ``delta`` comes in the subclass)."""
    index: int
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChoice(_ChatChoiceBase):
    message: ChatResponseMessage


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(_OmitsNoToolCalls):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCallItem] | None = None


class ChatStreamChoice(_ChatChoiceBase):
    delta: DeltaMessage


class ChatCompletionStreamResponse(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- misc endpoints
class ModelCard(OpenAIBase):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    tasks: list[str] | None = None  # what the model serves: generate, or embed / classify with score


class ModelList(OpenAIBase):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_RequestBase, _ChatTemplateFlags):
    """``POST /tokenize``: either ``prompt`` or chat ``messages`` (rendered as chat would)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True

    _RULES: ClassVar[tuple[dict[str, Any], ...]] = (_CONTINUE_WITHOUT_GENERATION_PROMPT, {"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})


class TokenizeResponse(OpenAIBase):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_RequestBase):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBase):
    prompt: str


class VersionResponse(OpenAIBase):
    version: str


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
