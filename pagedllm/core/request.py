"""Request: one sequence's prompt, output so far, and progress (``num_computed_tokens``: tokens
whose K/V is in the cache, catching up with ``num_tokens`` each step)."""

from __future__ import annotations

import enum
import time

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """[WAITING_FOR_GRAMMAR →] WAITING → RUNNING ⇄ PREEMPTED → FINISHED_*."""

    WAITING = 0
    WAITING_FOR_GRAMMAR = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4  # EOS, stop token or string, grammar terminated
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # failed in a step or grammar compile; the engine kept serving

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence (each child of an ``n > 1`` request is one). ``priority``: lower first;
    ``max_tokens``: the resolved output cap (ValueError if neither it nor the params' is set)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        max_tokens: int | None = None,
        parent_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.cache_salt = sampling_params.cache_salt  # enters the first block's hash
        self.lora_request = sampling_params.lora_request  # a pagedllm.lora.LoRARequest; its cache_key too
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.parent_id = parent_id  # of an n > 1 group
        mt = sampling_params.max_tokens if max_tokens is None else max_tokens
        if mt is None:
            raise ValueError("max_tokens must be resolved (engine fills it from max_model_len)")
        self.max_tokens: int = mt
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # -1: not yet admitted
        self.cached_tokens_by_tier: dict[str, int] | None = None
        self.num_preemptions = 0
        self.preemption_modes: list[str] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # stop token id or stop string
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.block_hashes: list[bytes] = []  # per full block, filled by the KV-cache manager
        # speculative decoding: the proposer's draft for the next step (never in all_token_ids),
        # and this request's totals of drafted and accepted tokens
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def block_hash_extra_keys(self) -> tuple | None:
        """The first block's extra hash keys (vLLM's ``extra_keys``): the cache salt and the adapter, so
        requests of different salts or adapters never share prefix-cache blocks."""
        keys = ((self.cache_salt,) if self.cache_salt else ()) + (
            (self.lora_request.cache_key,) if self.lora_request is not None else ())
        return keys or None

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")
