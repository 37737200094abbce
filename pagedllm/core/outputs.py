"""The two seams of the engine step, as plain dataclasses of ints and lists.

``SchedulerOutput`` goes from the scheduler to the model runner; ``ModelRunnerOutput``
comes back. No tensors and no model references cross this seam.

The model runner keeps per-request state (token ids, block table, sampling params)
between steps, keyed by request id:

1. It first drops the state of every id in ``finished_req_ids`` (finished, aborted or
   preempted since the previous step).
2. ``scheduled_new_reqs`` carry everything about a request the runner has not seen, or
   sees again after preemption (then ``token_ids`` = prompt + output so far).
3. ``scheduled_cached_reqs`` carry only what changed: new block ids appended to the
   block table, and ``num_computed_tokens`` (the scheduler's count, the authority).
   Block ids come per KV-cache group (one table per group; a single group for a model
   without sliding-window layers). Entries a sliding-window group freed are not
   announced: they lie outside the window of every token still to compute, so the
   attention never reads them (the runner may keep the stale id).
4. A request samples this step when, after this step's tokens, its KV covers every
   known token: ``num_computed_tokens + num_scheduled_tokens == len(token_ids)``; the
   runner then appends the sampled id to its own copy of ``token_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.step_cost import StepShape
from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner sees for the first time (or again after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # the whole block table of each KV-cache group
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hit), before this step


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed since the last step."""

    req_id: str
    new_block_ids: tuple[list[int], ...]  # appended to its block table, per KV-cache group
    num_computed_tokens: int  # before this step


@dataclass(frozen=True)
class TierSave:
    """Copy pool block ``block_id`` into offload tier ``tier`` under ``key`` (its block
    hash); ``parent_hash`` and ``token_ids`` are stored with it (a disk file needs them to
    be verified after a restart)."""

    tier: str
    key: bytes
    block_id: int
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


@dataclass
class KVTransferOps:
    """Copies the runner performs at the start of a step, before the forward pass, in this
    order — every read of the pool before any write to it:

    1. ``swap_out`` (``(block_id, swap slot)``: a victim of swap preemption, this step),
    2. ``saves`` (pool block → offload tier, evicted this step),
    3. ``loads`` (``(tier, key, block_id)``: tier → a pool block allocated this step),
    4. ``swap_in`` (``(swap slot, block_id)``: a swapped request resumed this step),
    5. ``drops`` (``(tier, key)``: forget the tier entry).

    See :mod:`pagedllm.core.kv_offload` and :mod:`pagedllm.core.swap_space` for why that
    order is safe."""

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
    """What the model runner computes this step."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # req_id -> tokens this step
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)  # drop runner state (finished/aborted/preempted)
    preempted_req_ids: set[str] = field(default_factory=set)  # subset of the above, for stats
    kv_transfers: KVTransferOps = field(default_factory=KVTransferOps)  # offload-tier copies, before the forward
    step_shape: StepShape | None = None  # the step's features for the step-cost model (the runner ignores it)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class SampleLogprobs:
    """Logprobs of one sampled position: the top-k and the sampled token's own.

    ``token_ids``/``logprobs`` are the top-k in descending order; ``sampled_token_id``'s
    logprob and rank (1 = most likely) are always present, even outside the top-k.
    """

    token_ids: list[int]
    logprobs: list[float]
    sampled_token_id: int
    sampled_logprob: float
    sampled_rank: int


@dataclass
class ModelRunnerOutput:
    """What one step produced.

    ``req_ids`` lists requests that sampled this step (in batch order) and
    ``sampled_token_ids[i]`` their new tokens (one per step without speculation).
    ``logprobs[req_id]`` is present for requests that asked for logprobs;
    ``prompt_logprobs[req_id]`` holds the prompt positions computed this step (one entry
    per prompt token, ``None`` for the first prompt token). ``failed`` maps a request id
    to an error message for requests that failed in this step (others are unaffected).
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, SampleLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[SampleLogprobs | None]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
