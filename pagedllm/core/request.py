"""Request: one sequence's prompt, its output so far, and its progress.

Progress is one number: ``num_computed_tokens`` (tokens whose K/V are in the cache).
Each step the scheduler lets it catch up with ``num_tokens`` (prompt + output) under the
token budget; prefill, chunked prefill, prefix hits and decode are all that one rule.
"""

from __future__ import annotations

import enum
import time

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Life cycle: [WAITING_FOR_GRAMMAR →] WAITING → RUNNING ⇄ PREEMPTED → one of the FINISHED_* states.

    A structured-output request waits in WAITING_FOR_GRAMMAR while its grammar compiles
    off the step loop; the scheduler skips it (it blocks nobody) until the engine
    declares the grammar ready.
    """

    WAITING = 0
    WAITING_FOR_GRAMMAR = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4  # EOS, a stop token id, a stop string, or the grammar terminated
    FINISHED_LENGTH_CAPPED = 5  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 6  # cancelled by the user / client gone
    FINISHED_ERROR = 7  # failed inside a step (or its grammar failed to compile); the engine kept serving

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason string, or None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence the scheduler runs (a child of an ``n > 1`` request is its own Request).

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt, token ids (non-empty).
        sampling_params: sampling and stopping parameters (``n`` must be 1 here).
        eos_token_id: the model's end-of-sequence id, or None.
        arrival_time: seconds (``time.time()``); default now.
        priority: lower value = served first under ``scheduling_policy="priority"``.
        max_tokens: resolved output cap in tokens (``sampling_params.max_tokens`` or
            what ``max_model_len`` leaves); default ``sampling_params.max_tokens``.
    """

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
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.parent_id = parent_id  # the user-facing id of an n > 1 group, if any
        mt = sampling_params.max_tokens if max_tokens is None else max_tokens
        if mt is None:
            raise ValueError("max_tokens must be resolved (engine fills it from max_model_len)")
        self.max_tokens: int = mt
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache (-1 = not yet scheduled)
        # num_cached_tokens split by where the K/V came from: "pool", "host", "disk" (set at the first admission)
        self.cached_tokens_by_tier: dict[str, int] | None = None
        self.num_preemptions = 0
        self.preemption_modes: list[str] = []  # "recompute" or "swap", one per preemption
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.block_hashes: list[bytes] = []  # filled by the KV-cache manager, one per full block

    @property
    def use_structured_output(self) -> bool:
        """Whether a grammar constrains this request's output (it then waits for its compile)."""
        return self.sampling_params.structured_outputs is not None

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens known so far."""
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
        """Append sampled tokens (the scheduler calls this in update_from_output)."""
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")
