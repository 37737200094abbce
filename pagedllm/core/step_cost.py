"""Step-cost model and the time-aware prompt-token budget of a step (why: ``docs/scheduler.md``)::

    seconds ~ base + per_decode_token * decode tokens + per_prefill_token * prefill tokens
                   + per_kilo_pair * attention query-key pairs / 1024
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def attention_pairs(num_computed_tokens: int, num_new_tokens: int) -> int:
    """Causal query-key pairs of ``num_new_tokens`` after ``num_computed_tokens`` cached ones."""
    n = num_new_tokens
    return n * num_computed_tokens + n * (n + 1) // 2


@dataclass(frozen=True)
class StepShape:
    """A step's cost features: decode tokens (one per request), prefill tokens, attention pairs."""

    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_attention_pairs: int = 0

    def features(self) -> np.ndarray:
        return np.array([1.0, self.num_decode_tokens, self.num_prefill_tokens, self.num_attention_pairs / 1024.0])


@dataclass(frozen=True)
class StepCostCoefficients:
    """Seconds per step, per decode token, per prefill token, per 1,024 attention pairs."""

    base: float
    per_decode_token: float
    per_prefill_token: float
    per_kilo_pair: float

    def as_array(self) -> np.ndarray:
        return np.array([self.base, self.per_decode_token, self.per_prefill_token, self.per_kilo_pair])


# before any measurement: a prompt token ~0.5x a decode token, 1,024 pairs ~1/4 of a prompt token
DEFAULT_STEP_COST = StepCostCoefficients(base=0.03, per_decode_token=0.0035, per_prefill_token=0.002,
                                         per_kilo_pair=0.0005)
# typical size of each feature in a step: the ridge's units
_FEATURE_SCALE = np.array([1.0, 32.0, 256.0, 64.0])
_MIN_FRACTION = 0.1
_CLIP = 4.0
_DECODE = [0, 1, 3]  # the decode part's features


class StepCostModel:
    """Online linear model of a step's wall time; ``decay`` per step in (0, 1], ``prior_weight`` in
    observations (ValueError naming a bad one, or for a non-positive default)."""

    def __init__(self, default: StepCostCoefficients = DEFAULT_STEP_COST, decay: float = 0.95,
                 prior_weight: float = 0.1) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        if prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight!r}")
        self._default = default.as_array()
        if not (self._default > 0).all():
            raise ValueError(f"every default step-cost coefficient must be positive, got {default}")
        self.decay = decay
        self.prior_weight = prior_weight
        self._load_num = self._load_den = 0.0  # load = observed / default, least squares
        self._dec_xx = np.zeros((3, 3))
        self._dec_xy = np.zeros(3)
        self._pre_xx = self._pre_xy = 0.0
        self._coef = self._default.copy()
        self.num_observations = 0

    @property
    def coefficients(self) -> StepCostCoefficients:
        return StepCostCoefficients(*(float(c) for c in self._coef))

    def predict(self, shape: StepShape) -> float:
        return float(shape.features() @ self._coef)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Refit on a step of ``shape`` that took ``seconds`` (bad times, empty steps ignored)."""
        if not (seconds > 0 and math.isfinite(seconds)) or shape == StepShape():
            return
        x = shape.features()
        pred = float(x @ self._coef)
        y = min(max(seconds, pred / _CLIP), pred * _CLIP)
        g = self.decay
        d = float(x @ self._default)
        self._load_num, self._load_den = g * self._load_num + d * y, g * self._load_den + d * d
        self._dec_xx *= g
        self._dec_xy *= g
        self._pre_xx *= g
        self._pre_xy *= g
        if shape.num_prefill_tokens == 0:
            xd = x[_DECODE]
            self._dec_xx += np.outer(xd, xd)
            self._dec_xy += xd * y
        else:
            rest = y - float(x[_DECODE] @ self._coef[_DECODE])
            self._pre_xx += float(x[2]) ** 2
            self._pre_xy += float(x[2]) * rest
        self.num_observations += 1
        self._refit()

    def _refit(self) -> None:
        scale = self._load_num / self._load_den if self._load_den > 0 else 1.0
        ref = max(scale, 1e-3) * self._default
        penalty = self.prior_weight * np.diag(_FEATURE_SCALE[_DECODE] ** 2)
        coef = self._coef.copy()
        coef[_DECODE] = np.linalg.solve(self._dec_xx + penalty, self._dec_xy + penalty @ ref[_DECODE])
        p = self.prior_weight * _FEATURE_SCALE[2] ** 2
        coef[2] = (self._pre_xy + p * ref[2]) / (self._pre_xx + p)
        self._coef = np.maximum(coef, _MIN_FRACTION * ref)

    def prefill_seconds(self, num_computed_tokens: int, num_new_tokens: int) -> float:
        pairs = attention_pairs(num_computed_tokens, num_new_tokens)
        return float(self._coef[2] * num_new_tokens + self._coef[3] * pairs / 1024.0)

    def max_prefill_tokens(self, seconds: float, num_computed_tokens: int) -> int:
        """Most prompt tokens after ``num_computed_tokens`` adding <= ``seconds`` (a quadratic's root)."""
        if seconds <= 0:
            return 0
        a = self._coef[3] / 2048.0  # pairs/1024 = (n c + n (n+1) / 2) / 1024
        b = self._coef[2] + self._coef[3] * (num_computed_tokens + 0.5) / 1024.0
        n = int((-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a)) if a > 0 else int(seconds / b)
        while n > 0 and self.prefill_seconds(num_computed_tokens, n) > seconds:  # rounding at the root
            n -= 1
        return n


class PrefillTimeBudget:
    """One step's prompt allowance: after the decodes, the first :meth:`limit` fixes the target
    ``max(ratio x`` their predicted time``, max_step_time_s)``; the first chunk may always take
    ``min_tokens``, so prompts progress whatever the prediction."""

    def __init__(self, model: StepCostModel, max_step_time_ratio: float | None, max_step_time_s: float | None,
                 min_tokens: int) -> None:
        self.model = model
        self.ratio = max_step_time_ratio
        self.floor_s = max_step_time_s
        self.min_tokens = min_tokens
        self._num_decodes = 0
        self._decode_pairs = 0
        self._left_s: float | None = None
        self._taken: dict[str, float] = {}

    def add_decode(self, num_computed_tokens: int) -> None:
        self._num_decodes += 1
        self._decode_pairs += attention_pairs(num_computed_tokens, 1)

    def limit(self, num_computed_tokens: int) -> int | None:
        """Most tokens the next chunk may take; None: no decode, no limit."""
        if self._num_decodes == 0:
            return None
        if self._left_s is None:
            decode_s = self.model.predict(StepShape(self._num_decodes, 0, self._decode_pairs))
            target = max(decode_s * (self.ratio or 1.0), self.floor_s or 0.0)
            self._left_s = target - decode_s
        n = self.model.max_prefill_tokens(self._left_s, num_computed_tokens)
        return max(n, self.min_tokens) if not self._taken else n

    def take(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> None:
        cost = self.model.prefill_seconds(num_computed_tokens, num_new_tokens)
        self._taken[request_id] = cost
        if self._left_s is not None:
            self._left_s -= cost

    def give_back(self, request_id: str) -> None:
        cost = self._taken.pop(request_id, None)
        if cost is not None and self._left_s is not None:
            self._left_s += cost
