"""The proposer interface: one class per method (n-gram, suffix; a draft model or a learned head
such as EAGLE/MTP is one more subclass)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from pagedllm.core.request import Request


class Proposer(ABC):
    """Drafts the next tokens of running requests from their tokens so far (prompt + output).
    A draft is a point mass per position (the verifier's rejection sampling reduces to "accept
    while the target's sample equals the draft"); a proposer with its own distributions would
    return them too, for :func:`pagedllm.worker.rejection_sampler.rejection_sample`."""

    @abstractmethod
    def propose(self, request: Request, num_tokens: int) -> list[int]:
        """At most ``num_tokens`` draft tokens to follow ``request.all_token_ids`` (may be empty).
        Must not change ``request``."""

    def propose_batch(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """One draft per request (a batched proposer, such as a draft model, overrides this)."""
        return [self.propose(r, n) if n > 0 else [] for r, n in zip(requests, num_tokens)]

    def seconds_per_draft_token(self) -> float:
        """Measured wall time one draft token costs the proposer (0.0: negligible, as a lookup's);
        the drafter adds it to a draft position's cost."""
        return 0.0

    def on_request_finished(self, request: Request) -> None:
        """``request`` ended with its output (a proposer that learns from past outputs keeps it)."""

    def forget(self, request_id: str) -> None:
        """Drop any per-request state (the request ended, or was aborted)."""
