"""StepBudget: what one scheduler step may still take (mini-sglang's ``PrefillAdder``).

The token budget, the prompt-token cap while decoding, the time budget and the partial-prefill
slots, charged per request by ``take_*`` and returned in one :meth:`StepBudget.give_back` call.
Token counts throughout; the policies are in ``docs/scheduler.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.core.step_cost import PrefillTimeBudget, StepCostModel


@dataclass
class _Charge:
    num_tokens: int
    is_prompt: bool


class StepBudget:
    """One step's allowances; build one per ``schedule()`` call.

    Args:
        num_tokens: the token budget (``max_num_batched_tokens``).
        num_prompt_tokens: prompt tokens the step may carry (<= ``num_tokens``).
        time_budget: the time-aware prompt allowance, or None for none.
        long_prefill_threshold: prompts with more tokens left than this are long (0: none is).
        max_num_partial_prefills: prompts the step may leave unfinished.
        max_long_partial_prefills: of those, how many may be long.
    """

    def __init__(self, num_tokens: int, num_prompt_tokens: int, time_budget: PrefillTimeBudget | None = None,
                 long_prefill_threshold: int = 0, max_num_partial_prefills: int = 1,
                 max_long_partial_prefills: int = 1) -> None:
        self.num_tokens_left = self.num_tokens = num_tokens
        self.num_prompt_tokens_left = num_prompt_tokens
        self.time_budget = time_budget
        self.long_prefill_threshold = long_prefill_threshold
        self.max_num_partial_prefills = max_num_partial_prefills
        self.max_long_partial_prefills = max_long_partial_prefills
        self._charges: dict[str, _Charge] = {}
        self._partial_ids: set[str] = set()
        self._long_partial_ids: set[str] = set()

    @classmethod
    def for_step(cls, config: EngineConfig, step_cost: StepCostModel, is_decoding: bool) -> StepBudget:
        """The allowances of a step; ``is_decoding``: some running request computes one token.
        Prompt tokens are capped (``max_prefill_tokens_while_decoding``, the time budget) only
        then, and only with chunked prefill on: a step nobody waits on takes the whole budget."""
        num_prompt = config.token_budget
        cap = config.max_prefill_tokens_while_decoding
        if is_decoding and cap is not None and config.enable_chunked_prefill:
            num_prompt = min(cap, config.token_budget)
        time_budget = None
        if config.is_step_time_budget_on:
            ms = config.max_step_time_ms
            time_budget = PrefillTimeBudget(step_cost, config.max_step_time_ratio or None, ms / 1000.0 if ms else None,
                                            config.min_prefill_tokens_while_decoding or config.block_size)
        return cls(config.token_budget, num_prompt, time_budget, config.long_prefill_threshold,
                   config.max_num_partial_prefills, config.max_long_partial_prefills)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens taken so far (net of what was given back)."""
        return self.num_tokens - self.num_tokens_left

    @property
    def has_prompt_room(self) -> bool:
        """Whether a waiting request could still get a token."""
        return min(self.num_tokens_left, self.num_prompt_tokens_left) > 0

    def is_long(self, num_left: int) -> bool:
        """A prompt with ``num_left`` tokens to compute is long (vLLM's ``long_prefill_token_threshold``)."""
        return 0 < self.long_prefill_threshold < num_left

    def prompt_limit(self, num_left: int, num_computed: int) -> int:
        """Most tokens the next prompt chunk may take: ``num_left`` tokens to compute after
        ``num_computed`` computed ones. May be <= 0 (nothing left)."""
        limit = min(self.num_tokens_left, self.num_prompt_tokens_left)
        if self.is_long(num_left):
            limit = min(limit, self.long_prefill_threshold)
        if self.time_budget is not None:
            time_limit = self.time_budget.limit(num_computed)
            if time_limit is not None:
                limit = min(limit, time_limit)
        return limit

    def partial_refusal(self, num_left: int, num_new: int) -> str | None:
        """Why a chunk of ``num_new`` of ``num_left`` prompt tokens may not run: ``"full"`` (every
        partial-prefill slot taken), ``"long"`` (every long slot taken), or None. A chunk that
        finishes its prompt always may."""
        if num_new >= num_left:
            return None
        if len(self._partial_ids) >= self.max_num_partial_prefills:
            return "full"
        if self.is_long(num_left) and len(self._long_partial_ids) >= self.max_long_partial_prefills:
            return "long"
        return None

    def take_prompt(self, request_id: str, num_new: int, num_computed: int, num_left: int) -> None:
        """Charge a prompt chunk: the token budget, the prompt cap, a partial-prefill slot when
        it leaves tokens of its prompt uncomputed, and the time budget."""
        self._charge(request_id, num_new, True)
        self.num_prompt_tokens_left -= num_new
        if num_new < num_left:
            self._partial_ids.add(request_id)
            if self.is_long(num_left):
                self._long_partial_ids.add(request_id)
        if self.time_budget is not None:
            self.time_budget.take(request_id, num_computed, num_new)

    def take_decode(self, request_id: str, num_computed: int) -> None:
        """Charge one decode token; the time budget counts the decode into its target."""
        self._charge(request_id, 1, False)
        if self.time_budget is not None:
            self.time_budget.add_decode(num_computed)

    def take_tokens(self, request_id: str, num_new: int) -> None:
        """Charge the token budget only (a request resuming from the swap space)."""
        self._charge(request_id, num_new, False)

    def give_back(self, request_id: str) -> None:
        """Undo every charge of ``request_id`` this step (it was preempted); a decode stays in
        the time budget's target. No-op for a request that took nothing."""
        charge = self._charges.pop(request_id, None)
        if charge is None:
            return
        self.num_tokens_left += charge.num_tokens
        if charge.is_prompt:
            self.num_prompt_tokens_left += charge.num_tokens
        self._partial_ids.discard(request_id)
        self._long_partial_ids.discard(request_id)
        if self.time_budget is not None:
            self.time_budget.give_back(request_id)

    def _charge(self, request_id: str, num_tokens: int, is_prompt: bool) -> None:
        if request_id in self._charges:
            raise ValueError(f"request {request_id!r} was already charged this step")
        self._charges[request_id] = _Charge(num_tokens, is_prompt)
        self.num_tokens_left -= num_tokens
