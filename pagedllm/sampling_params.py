"""SamplingParams: how one request is sampled and when it stops.

Field names, meanings and defaults follow vLLM's ``SamplingParams`` (and through it the
OpenAI API), so users can bring their settings unchanged. No torch import here.

Conventions (documented choices where engines differ):

- ``temperature == 0`` is greedy (argmax); top-k/top-p/min-p are then ignored. Temperatures
  below ``SAMPLING_EPS`` (1e-5) are treated as greedy too: dividing logits by them would
  overflow float32 to inf and softmax to NaN.
- ``top_k``: 0 or -1 disable it; values above the vocabulary size mean "no top-k".
- ``top_p`` must lie in (0, 1]; 0 is rejected (an empty candidate set has no meaning).
  A tiny top_p such as 1e-9 keeps only the most likely token (= greedy).
- ``presence_penalty`` / ``frequency_penalty`` count *output* tokens only (OpenAI);
  ``repetition_penalty`` covers prompt + output tokens, applied once per distinct token
  (CTRL paper, Keskar et al. 2019; as in HF transformers and vLLM).
- ``logprobs`` are the log-softmax of the *processed* logits: after allowed_token_ids,
  bad_words, min_tokens masks, logit_bias, penalties and temperature (1 for temperature
  0), before top-k/top-p/min-p truncation; excluded tokens report a finite floor
  (-9999.0), never -inf. ``prompt_logprobs`` are the raw model distribution.
- ``max_tokens=None`` means "up to max_model_len".
- ``min_tokens`` counts delivered output tokens; EOS and ``stop_token_ids`` are masked
  and stop strings are not matched until it is reached.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

_MAX_SEED = 2**63 - 1

# Temperatures below this are greedy (argmax): logits / 1e-6 overflows float32.
SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a streaming request carries."""

    CUMULATIVE = 0  # all text/tokens so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters (vLLM-compatible).

    Raises:
        ValueError: naming the field, for any out-of-range or wrongly typed value.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled in by the engine (tokenizer-dependent), not by users.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

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
        self._validate()

    # ---- validation -----------------------------------------------------------------
    def _validate(self) -> None:
        _int("n", self.n, lo=1)
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
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                _int("logit_bias", tok, lo=0)
                _num("logit_bias", bias, lo=-100.0, hi=100.0)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            for t in self.allowed_token_ids:
                _int("allowed_token_ids", t, lo=0)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    def validate_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Check the token-id and logprob fields against the model.

        Raises ValueError naming the field when a token id is >= ``vocab_size`` or a
        logprobs count exceeds ``max_logprobs``.
        """
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

    # ---- derived --------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature < SAMPLING_EPS, or top_k 1)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def clone(self) -> "SamplingParams":
        """A deep copy (children of an ``n > 1`` request each get one)."""
        return copy.deepcopy(self)

    def child(self, index: int) -> "SamplingParams":
        """Parameters of child ``index`` of an ``n > 1`` request: n=1, seed + index.

        Distinct seeds make the n samples differ while staying reproducible.
        """
        p = self.clone()
        p.n = 1
        if p.seed is not None:
            p.seed = (p.seed + index) % _MAX_SEED
        return p


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
