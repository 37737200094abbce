"""Step-cost model and the time-aware prompt-token budget of a step (no torch).

Why: on a compute-bound device (CPU) an engine step's wall time grows with the tokens it
carries, and every decoding stream waits for the whole step, so each prompt token that
rides along with decodes stretches every stream's inter-token gap. A fixed token cap
(``max_prefill_tokens_while_decoding``) cannot fit every batch: 64 prompt tokens stretch a
1-stream decode step ~3x but a 48-stream one ~1.7x, and a chunk deep into a long prompt
costs more per token (attention over its context). The scheduler instead asks this model
how long a step would take and adds prompt tokens only up to a time target — Sarathi-Serve's
token budget from a time-between-tokens target (Agrawal et al., OSDI 2024), with the cost
measured online rather than profiled once.

The model (linear in the step's shape, :class:`StepShape`)::

    seconds ~ base + per_decode_token * decode tokens + per_prefill_token * prefill tokens
                   + per_kilo_pair * attention query-key pairs / 1024

fitted in two stages by exponentially weighted least squares over the engine's own steps
(forgetting factor ``decay``: the machine's load drifts). The decode part (base,
per_decode_token, per_kilo_pair) is fitted on steps without prompt tokens only; the prompt
part (per_prefill_token) on the rest of the mixed steps' time once the decode part is
taken out. One joint fit cannot tell them apart: while streams ramp up, every step carries
both decodes and a growing prompt chunk (collinear features), and it charged the chunk to
the decodes, predicted a decode-only step several times too long and let ever larger
chunks in. Two stages fail safe instead: a load rise seen only on mixed steps makes prompt
tokens look dearer (smaller chunks), never the decodes. Each stage is ridge-regularised
toward the default coefficients scaled by the current load (observed / default over all
recent steps), so a coefficient the recent steps do not exercise (the decode part during a
phase where every step carries a chunk) follows the load instead of going stale, each
coefficient kept at >= 10% of that scaled default (a negative cost is noise). A step's
observed time is clipped to [1/4, 4] x the prediction before it is used, so one outlier (a
page fault storm, another process taking the cores) moves the fit by a bounded step. The
engine feeds it (:meth:`StepCostModel.observe`); the scheduler asks it
(:class:`PrefillTimeBudget`). Seconds throughout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def attention_pairs(num_computed_tokens: int, num_new_tokens: int) -> int:
    """Query-key pairs attention computes for ``num_new_tokens`` new tokens after
    ``num_computed_tokens`` cached ones (causal: new token i sees ``num_computed + i + 1``)."""
    n = num_new_tokens
    return n * num_computed_tokens + n * (n + 1) // 2


@dataclass(frozen=True)
class StepShape:
    """What a step costs depends on (all counts over the step's scheduled requests):
    ``num_decode_tokens`` (requests computing one token), ``num_prefill_tokens`` (tokens of
    requests computing more than one), ``num_attention_pairs`` (query-key pairs of all of
    them, :func:`attention_pairs`)."""

    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_attention_pairs: int = 0

    def features(self) -> np.ndarray:
        """(4,) float64: 1, decode tokens, prefill tokens, attention pairs / 1024."""
        return np.array([1.0, self.num_decode_tokens, self.num_prefill_tokens, self.num_attention_pairs / 1024.0])


@dataclass(frozen=True)
class StepCostCoefficients:
    """Seconds per unit of each term of the model: ``base`` per step, ``per_decode_token``,
    ``per_prefill_token``, ``per_kilo_pair`` (per 1,024 attention query-key pairs)."""

    base: float
    per_decode_token: float
    per_prefill_token: float
    per_kilo_pair: float

    def as_array(self) -> np.ndarray:
        return np.array([self.base, self.per_decode_token, self.per_prefill_token, self.per_kilo_pair])


# Starting point before any step is measured, SmolLM2-135M in float32 on the 2-core Xeon:
# base + 32 decode tokens = the ~146 ms decode step at batch 32 of a quiet machine
# (benchmarks/step_profile.py); a prompt token ~0.5x a decode token's marginal cost
# (benchmarks/results/step_cost.json, loaded machine: the ratio, not the scale); 1,024
# attention pairs ~1/4 of a prompt token (4 x head_dim x heads FLOPs per pair and layer vs
# 2 x parameters per token). The online fit replaces the scale within a few steps.
DEFAULT_STEP_COST = StepCostCoefficients(base=0.03, per_decode_token=0.0035, per_prefill_token=0.002,
                                         per_kilo_pair=0.0005)
# Typical size of each feature in one step: the ridge penalty's units (seconds^2 like one
# observation's squared error), so one pseudo-observation pulls each coefficient.
_FEATURE_SCALE = np.array([1.0, 32.0, 256.0, 64.0])
_MIN_FRACTION = 0.1  # each coefficient >= this fraction of the load-scaled default
_CLIP = 4.0  # an observation counts as at most this factor off the prediction
_DECODE = [0, 1, 3]  # the decode part's features: 1, decode tokens, attention pairs


class StepCostModel:
    """Online linear model of an engine step's wall time (see the module docstring).

    Args:
        default: coefficients before any observation, and the shape the ridge pulls toward.
        decay: forgetting factor per observed step, in (0, 1] (0.95: ~20 steps of memory).
        prior_weight: strength of the pull toward the load-scaled default, in observations.

    Raises:
        ValueError: ``decay`` outside (0, 1], a negative ``prior_weight``, or a default
            coefficient that is not positive.
    """

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
        self._load_num = self._load_den = 0.0  # the load: sums of default-predicted x observed, predicted^2
        self._dec_xx = np.zeros((3, 3))  # decode stage: features 1, decode tokens, pairs / 1024
        self._dec_xy = np.zeros(3)
        self._pre_xx = self._pre_xy = 0.0  # prompt stage: prefill tokens vs the time the decode part leaves
        self._coef = self._default.copy()
        self.num_observations = 0

    @property
    def coefficients(self) -> StepCostCoefficients:
        """The current fit (seconds per unit)."""
        return StepCostCoefficients(*(float(c) for c in self._coef))

    def predict(self, shape: StepShape) -> float:
        """Predicted wall time of a step of ``shape``, in seconds."""
        return float(shape.features() @ self._coef)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record that a step of ``shape`` took ``seconds`` (wall); refits the coefficients.
        Non-positive or non-finite times and empty steps are ignored."""
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
        else:  # the prompt tokens' share: what the current decode part leaves of the step
            rest = y - float(x[_DECODE] @ self._coef[_DECODE])
            self._pre_xx += float(x[2]) ** 2
            self._pre_xy += float(x[2]) * rest
        self.num_observations += 1
        self._refit()

    def _refit(self) -> None:
        scale = self._load_num / self._load_den if self._load_den > 0 else 1.0  # observed / default
        ref = max(scale, 1e-3) * self._default
        penalty = self.prior_weight * np.diag(_FEATURE_SCALE[_DECODE] ** 2)
        coef = self._coef.copy()
        coef[_DECODE] = np.linalg.solve(self._dec_xx + penalty, self._dec_xy + penalty @ ref[_DECODE])
        p = self.prior_weight * _FEATURE_SCALE[2] ** 2
        coef[2] = (self._pre_xy + p * ref[2]) / (self._pre_xx + p)
        self._coef = np.maximum(coef, _MIN_FRACTION * ref)

    def prefill_seconds(self, num_computed_tokens: int, num_new_tokens: int) -> float:
        """Seconds ``num_new_tokens`` prompt tokens after ``num_computed_tokens`` add to a step."""
        pairs = attention_pairs(num_computed_tokens, num_new_tokens)
        return float(self._coef[2] * num_new_tokens + self._coef[3] * pairs / 1024.0)

    def max_prefill_tokens(self, seconds: float, num_computed_tokens: int) -> int:
        """Most prompt tokens after ``num_computed_tokens`` that add at most ``seconds`` to a
        step (0 when not even one does): the root of the quadratic cost in the token count."""
        if seconds <= 0:
            return 0
        a = self._coef[3] / 2048.0  # pairs/1024 = (n c + n (n+1) / 2) / 1024
        b = self._coef[2] + self._coef[3] * (num_computed_tokens + 0.5) / 1024.0
        n = int((-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a)) if a > 0 else int(seconds / b)
        while n > 0 and self.prefill_seconds(num_computed_tokens, n) > seconds:  # float rounding at the root
            n -= 1
        return n


class PrefillTimeBudget:
    """One step's time-aware allowance of prompt tokens while requests decode.

    The scheduler reports the step's decodes first (:meth:`add_decode`); at the first
    prompt chunk the target is fixed: ``max(max_step_time_ratio x`` the predicted time of
    the step with only those decodes, ``max_step_time_ms)``; prompt chunks then take what
    is left of it (:meth:`limit`, :meth:`take`). A step with no decode has no time limit
    (nobody waits between tokens). The step's first prompt chunk may always take
    ``min_tokens``: every prompt progresses whatever the model predicts, and while few
    streams decode (short decode steps) prompts are still admitted at least that fast.

    Args:
        model: the step-cost model.
        max_step_time_ratio: >= 1, or None (no ratio target).
        max_step_time_s: a floor of the target in seconds, or None.
        min_tokens: prompt tokens the first chunk of a step may always take (>= 1).
    """

    def __init__(self, model: StepCostModel, max_step_time_ratio: float | None, max_step_time_s: float | None,
                 min_tokens: int) -> None:
        self.model = model
        self.ratio = max_step_time_ratio
        self.floor_s = max_step_time_s
        self.min_tokens = min_tokens
        self._num_decodes = 0
        self._decode_pairs = 0
        self._left_s: float | None = None  # seconds prompt tokens may still add; None until fixed
        self._taken: dict[str, float] = {}

    def add_decode(self, num_computed_tokens: int) -> None:
        """Count a decode scheduled this step (its context: ``num_computed_tokens``)."""
        self._num_decodes += 1
        self._decode_pairs += attention_pairs(num_computed_tokens, 1)

    def limit(self, num_computed_tokens: int) -> int | None:
        """Most tokens the next prompt chunk (after ``num_computed_tokens``) may take; None:
        no time limit (no decode in the step)."""
        if self._num_decodes == 0:
            return None
        if self._left_s is None:
            decode_s = self.model.predict(StepShape(self._num_decodes, 0, self._decode_pairs))
            target = max(decode_s * (self.ratio or 1.0), self.floor_s or 0.0)
            self._left_s = target - decode_s
        n = self.model.max_prefill_tokens(self._left_s, num_computed_tokens)
        return max(n, self.min_tokens) if not self._taken else n

    def take(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> None:
        """Charge a prompt chunk scheduled this step."""
        cost = self.model.prefill_seconds(num_computed_tokens, num_new_tokens)
        self._taken[request_id] = cost
        if self._left_s is not None:
            self._left_s -= cost

    def give_back(self, request_id: str) -> None:
        """Undo :meth:`take` for a request unscheduled this step (preempted)."""
        cost = self._taken.pop(request_id, None)
        if cost is not None and self._left_s is not None:
            self._left_s += cost
