"""The engine step's two seams: ``SchedulerOutput`` to the runner, ``ModelRunnerOutput`` back.
The runner drops ``finished_req_ids`` (finished, aborted, preempted) first, takes
``scheduled_new_reqs`` whole (token ids: prompt + output so far), appends ``scheduled_cached_reqs``'
new block ids (blocks a sliding group freed are not announced) after dropping its last
``num_dropped_blocks`` (blocks only a rejected draft used); ``num_computed_tokens`` is the
scheduler's. A request samples when ``num_computed_tokens + num_scheduled_tokens >= len(token_ids)``;
with ``scheduled_spec_decode_tokens`` (k drafts) its 1 + k scheduled tokens are its last token and
the drafts, verified in the same forward (``docs/speculative-decoding.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.step_cost import StepShape
from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # per KV-cache group
    num_computed_tokens: int  # before this step


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: tuple[list[int], ...]  # per KV-cache group
    num_computed_tokens: int
    num_dropped_blocks: int = 0  # tail blocks freed since the last step (rejected drafts')


@dataclass(frozen=True)
class TierSave:

    tier: str
    key: bytes
    block_id: int
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


@dataclass
class KVTransferOps:
    """Copies before the forward, every read of the pool before any write to it: ``swap_out``
    ``(block_id, slot)``, ``saves``, ``loads`` ``(tier, key, block_id)``, ``swap_in``, ``drops``."""

    saves: list[TierSave] = field(default_factory=list)
    loads: list[tuple[str, bytes, int]] = field(default_factory=list)
    drops: list[tuple[str, bytes]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.saves or self.loads or self.drops or self.swap_out or self.swap_in)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # batch order
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)  # for stats
    kv_transfers: KVTransferOps = field(default_factory=KVTransferOps)
    step_shape: StepShape | None = None  # for the step-cost model
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts to verify

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class SampleLogprobs:
    """One position's top-k (descending) and the sampled token's logprob and rank (1 = top)."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_token_id: int
    sampled_logprob: float
    sampled_rank: int


@dataclass
class ModelRunnerOutput:
    """The requests that sampled (batch order), their tokens (a verify step: the accepted drafts
    and one more; ``logprobs`` then a list, one per token) and logprobs, this step's prompt
    logprobs (None for the first prompt token), ``failed``: request id → error, ``retried``: scheduled
    requests the step did not run (scheduled again as they were), ``failed_tier_keys``: ``(tier, key)``
    blocks a tier could not store (the index forgets them); ``hidden_states``: the final hidden state
    of the last prompt token of each request whose params ask for it, at its first sample."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, SampleLogprobs | list[SampleLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[SampleLogprobs | None]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    retried: set[str] = field(default_factory=set)
    failed_tier_keys: list[tuple[str, bytes]] = field(default_factory=list)
    hidden_states: dict[str, list[float]] = field(default_factory=dict)
