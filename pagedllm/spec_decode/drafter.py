"""The drafter: after each step, which running requests draft how many tokens, from the
proposer, into ``Request.spec_token_ids`` (the scheduler fits them into the next step).

When to speculate is the step-cost model's call (``core/step_cost.py``)::

    a step of B decodes yields B tokens in T0 = predict(B decodes): r0 = B / T0 tokens per second
    draft position j of a request with acceptance a adds a**j tokens for dt = one more query token
                                                  (+ the proposer's measured cost of a draft token)
    keep position j while a**j > MARGIN * r0 * dt          (marginal gain beats the step's rate)

so a large batch (compute-bound: dt ~ the decode token's cost) drafts nothing (the per-step
off-switch), and a request whose acceptance stays low drafts nothing (per-request off-switch,
re-probed as its estimate relaxes back to the prior). The acceptance is estimated per request
from its verified drafts (a truncated geometric: successes / trials, decayed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import Request
from pagedllm.core.step_cost import StepCostModel, StepShape, attention_pairs
from pagedllm.spec_decode.proposer import Proposer

MARGIN = 1.25  # a draft position must beat the step's token rate by this factor
PRIOR_ACCEPTANCE = 0.6  # before a request's first verified draft
PRIOR_WEIGHT = 1.0  # in trials
DECAY = 0.9  # per verified draft
RELAX = 0.02  # per step without a draft: the estimate drifts back toward the prior (re-probing)


@dataclass
class _Acceptance:
    num_accepted: float = 0.0
    num_trials: float = 0.0
    seen_drafted: int = 0  # request.num_draft_tokens already counted
    seen_accepted: int = 0

    @property
    def rate(self) -> float:
        return (self.num_accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.num_trials + PRIOR_WEIGHT)

    def update(self, request: Request) -> bool:
        """Fold in the request's drafts verified since the last call; False when none."""
        drafted = request.num_draft_tokens - self.seen_drafted
        accepted = request.num_accepted_tokens - self.seen_accepted
        self.seen_drafted, self.seen_accepted = request.num_draft_tokens, request.num_accepted_tokens
        if drafted <= 0:
            return False
        self.num_accepted = DECAY * self.num_accepted + accepted
        self.num_trials = DECAY * self.num_trials + accepted + (1 if accepted < drafted else 0)
        return True

    def relax(self) -> None:
        self.num_accepted *= 1 - RELAX
        self.num_trials *= 1 - RELAX


class Drafter:
    """Owns the proposer and each request's acceptance estimate; engine thread only."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self._acceptance: dict[str, _Acceptance] = {}
        self._proposed: set[str] = set()  # requests the proposer has drafted for (its state to forget)

    def step(self, running: Sequence[Request], finished: Sequence[Request], step_cost: StepCostModel) -> None:
        """Set ``spec_token_ids`` of every running request that decodes next (others: ``[]``);
        ``finished``: requests that ended this step (their outputs may teach the proposer)."""
        for req in finished:
            self.proposer.on_request_finished(req)
        live = {r.request_id for r in running}
        for rid in (self._acceptance.keys() | self._proposed) - live:  # ended or preempted
            self._acceptance.pop(rid, None)
            self._proposed.discard(rid)
            self.proposer.forget(rid)
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1 and not r.is_finished]
        for req in running:
            req.spec_token_ids = []
        limits = self._draft_limits(decoding, step_cost)
        chosen = [(r, n) for r, n in zip(decoding, limits) if n > 0]
        drafts = self.proposer.propose_batch([r for r, _ in chosen], [n for _, n in chosen])
        self._proposed.update(r.request_id for r, _ in chosen)
        for (req, _), draft in zip(chosen, drafts):
            req.spec_token_ids = list(draft)

    def _draft_limits(self, decoding: list[Request], step_cost: StepCostModel) -> list[int]:
        """Per request, how many draft tokens pay for themselves (0: no draft)."""
        cfg = self.config
        if not decoding or (cfg.disable_by_batch_size is not None and len(decoding) >= cfg.disable_by_batch_size):
            return [0] * len(decoding)
        num_pairs = sum(attention_pairs(r.num_computed_tokens, 1) for r in decoding)
        t0 = step_cost.predict(StepShape(len(decoding), 0, num_pairs))
        rate = len(decoding) / t0
        coef = step_cost.coefficients
        draft_cost = self.proposer.seconds_per_draft_token()
        limits = []
        for req in decoding:
            acc = self._acceptance.setdefault(req.request_id, _Acceptance(seen_drafted=req.num_draft_tokens,
                                                                          seen_accepted=req.num_accepted_tokens))
            if not acc.update(req):
                acc.relax()
            dt = coef.per_prefill_token + coef.per_kilo_pair * (req.num_computed_tokens + 1) / 1024.0 + draft_cost
            alpha, n = acc.rate, 0
            while n < cfg.num_speculative_tokens and alpha ** (n + 1) > MARGIN * rate * dt:
                n += 1
            limits.append(n)
        return limits

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop these requests' state now (aborted: a draft model's blocks are freed at once)."""
        for rid in request_ids:
            self._acceptance.pop(rid, None)
            self._proposed.discard(rid)
            self.proposer.forget(rid)

    def acceptance_rate(self, request_id: str) -> float | None:
        """The request's current acceptance estimate (None when it is not tracked)."""
        acc = self._acceptance.get(request_id)
        return acc.rate if acc is not None else None


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer for ``config.method``."""
    if config.method == "ngram":
        from pagedllm.spec_decode.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from pagedllm.spec_decode.suffix import SuffixProposer

        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    raise ValueError(f"speculative_config.method {config.method!r} has no torch-free proposer "
                     f"(draft_model's is pagedllm.worker.draft_model, built by the engine)")
