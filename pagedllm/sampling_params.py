"""SamplingParams: how one request is sampled and when it stops (vLLM's fields and defaults;
where engines differ, ``docs/architecture.md`` "Sampling conventions"). No torch."""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any

_MAX_SEED = 2**63 - 1

# Temperatures below this are greedy (argmax): logits / 1e-6 overflows float32.
SAMPLING_EPS = 1e-5


# Bounds on what one request may ask for (docs/robustness.md): each scales its memory or CPU.
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 100_000  # all stop strings together
MAX_LOGIT_BIAS = 1024  # entries
MAX_PROMPTS = 1024  # prompts in one completions request

def _f(default: Any, help: str) -> Any:
    """A user-facing sampling field; its help text becomes the command-line flag's help."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ReasoningBoundary:
    """Where a constrained output's reasoning block ends, as token ids (vLLM's
    ``enable_in_reasoning: false``): the grammar starts after ``end_token_ids`` and the reasoning
    before it is free. ``start_token_ids`` empty: the output starts inside the block; else the
    output may open the block with them (a begun tag is finished), and an output that does not
    is all answer. ValueError naming the field for an empty end or a non-id."""

    end_token_ids: tuple[int, ...]
    start_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("end_token_ids", "start_token_ids"):
            ids = tuple(getattr(self, name))
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise ValueError(f"structured_outputs.reasoning_boundary.{name} must hold token ids, got {ids!r}")
            object.__setattr__(self, name, ids)
        if not self.end_token_ids:
            raise ValueError("structured_outputs.reasoning_boundary.end_token_ids must not be empty")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's ``StructuredOutputsParams``): exactly one of a JSON
    schema (dict or text), a whole-output regex, a choice of strings, an EBNF grammar (start rule
    ``root``) or any JSON object; ``whitespace_pattern`` must be None. ValueError naming the field
    for no kind, several or a wrong type; compiling is checked at admission.
    ``reasoning_boundary``: the grammar starts after the reasoning (set by the server's reasoning
    parser; None: it covers the whole output)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    reasoning_boundary: ReasoningBoundary | None = None

    def __post_init__(self) -> None:
        if self.reasoning_boundary is not None and not isinstance(self.reasoning_boundary, ReasoningBoundary):
            raise ValueError("structured_outputs.reasoning_boundary must be a ReasoningBoundary, "
                             f"got {self.reasoning_boundary!r}")
        if self.choice is not None:
            self.choice = _as_list("structured_outputs.choice", self.choice)
        kinds = self.kinds()
        if not kinds:
            raise ValueError("structured_outputs needs one of json, regex, choice, grammar or json_object")
        if len(kinds) > 1:
            raise ValueError(f"structured_outputs takes one kind of constraint, got {', '.join(kinds)}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or string), got {self.json!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty")
            for c in self.choice:
                if not isinstance(c, str) or not c:
                    raise ValueError(f"structured_outputs.choice must hold non-empty strings, got {c!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported (xgrammar backend)")

    def kinds(self) -> list[str]:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        return kinds + (["json_object"] if self.json_object else [])

    @property
    def kind(self) -> str:
        return self.kinds()[0]


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a streaming request carries."""

    CUMULATIVE = 0  # all text/tokens so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters; ValueError naming the field for a bad value."""

    n: int = _f(1, "samples per prompt")
    presence_penalty: float = _f(0.0, "penalty for output tokens already present, -2..2")
    frequency_penalty: float = _f(0.0, "penalty per occurrence in the output, -2..2")
    repetition_penalty: float = _f(1.0, "penalty on prompt and output tokens (1 = off)")
    temperature: float = _f(1.0, "0 = greedy")
    top_p: float = _f(1.0, "nucleus sampling mass (1 = off)")
    top_k: int = _f(0, "keep the k most likely tokens (0 or -1 = off)")
    min_p: float = _f(0.0, "min probability relative to the top token (0 = off)")
    seed: int | None = _f(None, "per-request sampling seed")
    stop: str | list[str] | None = _f(None, "stop string (repeatable)")
    stop_token_ids: list[int] | None = _f(None, "token ids that stop generation")
    bad_words: list[str] | None = _f(None, "words never generated (repeatable)")
    include_stop_str_in_output: bool = _f(False, "keep the matched stop string in the text")
    ignore_eos: bool = _f(False, "generate past the end-of-sequence token")
    max_tokens: int | None = _f(16, "most new tokens per sample (None = up to max_model_len)")
    min_tokens: int = _f(0, "fewest new tokens before EOS or a stop may end a sample")
    logprobs: int | None = _f(None, "log-probabilities of the top N tokens per output position")
    prompt_logprobs: int | None = _f(None, "log-probabilities of the top N tokens per prompt position")
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = _f(None, "generate only these token ids")
    skip_special_tokens: bool = _f(True, "leave special tokens out of the text")
    spaces_between_special_tokens: bool = _f(True, "put spaces between special tokens in the text")
    truncate_prompt_tokens: int | None = _f(None, "keep only the last N prompt tokens (-1 = as many as fit in "
                                                  "max_model_len with max_tokens)")
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    cache_salt: str | None = _f(None, "prefix-cache namespace: requests share cached blocks only with the same salt")
    # Filled in by the engine (tokenizer-dependent), not by users.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # the pooling runner over a decoder: the runner returns the last prompt token's final hidden state
    return_hidden_states: bool = field(default=False, repr=False)
    # The adapter (a pagedllm.lora.LoRARequest) the engine set from add_request's lora_request or the
    # server from the request's model name; it travels with the parameters to the scheduler and runner.
    lora_request: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = _as_list("stop", self.stop)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids or [])
        self.bad_words = _as_list("bad_words", self.bad_words or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = _parse_logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        _int("n", self.n, lo=1, hi=MAX_N)
        if len(self.stop) > MAX_STOP_STRINGS or sum(len(s) for s in self.stop if isinstance(s, str)) > MAX_STOP_CHARS:
            raise ValueError(f"stop allows at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in all")
        if self.logit_bias is not None and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias allows at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        _num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _num("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _num("temperature", self.temperature, lo=0.0)
        _num("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _int("top_k", self.top_k, lo=-1)
        _num("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _int("seed", self.seed, lo=-_MAX_SEED, hi=_MAX_SEED)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a non-empty string or a list of them, got {s!r}")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, lo=0)
        for w in self.bad_words:
            if not isinstance(w, str) or not w:
                raise ValueError(f"bad_words must be a list of non-empty strings, got {w!r}")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, lo=1)
        _int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, lo=0)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, lo=0)
        if self.truncate_prompt_tokens is not None:
            _int("truncate_prompt_tokens", self.truncate_prompt_tokens, lo=-1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be -1 (as many as fit) or >= 1, got 0")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                _int("logit_bias", tok, lo=0)
                _num("logit_bias", bias, lo=-100.0, hi=100.0)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            for t in self.allowed_token_ids:
                _int("allowed_token_ids", t, lo=0)
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams)):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    def validate_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Raise ValueError naming the field for a token id >= ``vocab_size`` or a logprobs
        count over ``max_logprobs``."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            for t in getattr(self, name) or []:
                if t >= vocab_size:
                    raise ValueError(f"{name} contains token id {t}, outside the vocabulary (size {vocab_size})")
        for t in (self.logit_bias or {}):
            if t >= vocab_size:
                raise ValueError(f"logit_bias has token id {t}, outside the vocabulary (size {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v > max_logprobs:
                raise ValueError(f"{name}={v} exceeds the maximum of {max_logprobs} (engine option max_logprobs)")

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature < SAMPLING_EPS, or top_k 1)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def clone(self) -> "SamplingParams":
        """A deep copy (children of an ``n > 1`` request each get one)."""
        return copy.deepcopy(self)

    def child(self, index: int) -> "SamplingParams":
        """Child ``index`` of an ``n > 1`` request: n=1, seed + index (distinct, reproducible)."""
        p = self.clone()
        p.n = 1
        if p.seed is not None:
            p.seed = (p.seed + index) % _MAX_SEED
        return p


_BOOL_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.type in ("bool", bool))


def sampling_field_names() -> list[str]:
    """The sampling fields a user sets (everything but ``output_kind`` and engine-filled ones)."""
    return [f.name for f in dataclasses.fields(SamplingParams) if f.name not in ("output_kind", "bad_words_token_ids", "lora_request")]


def _as_list(name: str, value: Any) -> list:
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return list(value)


def _parse_logit_bias(value: Any) -> dict[int, float]:
    """{token id: bias}; keys may be numeric strings (OpenAI JSON sends string keys)."""
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {value!r}")
    out: dict[int, float] = {}
    for k, v in value.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
        if isinstance(k, bool) or (isinstance(k, float) and k != tok):
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
        _num("logit_bias", v)
        out[tok] = float(v)
    return out


def _int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _num(name: str, value: Any, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
