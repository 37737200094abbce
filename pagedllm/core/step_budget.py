"""StepBudget: what one scheduler step may still take (mini-sglang's ``PrefillAdder``), charged
per request and given back in one call. Tokens throughout; policies: ``docs/scheduler.md``."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.core.step_cost import PrefillTimeBudget, StepCostModel


@dataclass
class _Charge:
    num_tokens: int
    is_prompt: bool


class StepBudget:
    """One step's token budget, prompt-token cap, time budget and partial-prefill slots."""

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
        """A step's allowances: prompt tokens are capped only ``is_decoding`` with chunked prefill
        (a step nobody waits on takes the whole budget)."""
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
        return self.num_tokens - self.num_tokens_left

    @property
    def has_prompt_room(self) -> bool:
        return min(self.num_tokens_left, self.num_prompt_tokens_left) > 0

    def is_long(self, num_left: int) -> bool:
        return 0 < self.long_prefill_threshold < num_left

    def prompt_limit(self, num_left: int, num_computed: int) -> int:
        """Most tokens the next prompt chunk may take (<= 0: none)."""
        limit = min(self.num_tokens_left, self.num_prompt_tokens_left)
        if self.is_long(num_left):
            limit = min(limit, self.long_prefill_threshold)
        if self.time_budget is not None:
            time_limit = self.time_budget.limit(num_computed)
            if time_limit is not None:
                limit = min(limit, time_limit)
        return limit

    def partial_refusal(self, num_left: int, num_new: int) -> str | None:
        """``"full"`` or ``"long"`` when no (long) partial-prefill slot is left for a chunk that
        leaves its prompt unfinished, else None."""
        if num_new >= num_left:
            return None
        if len(self._partial_ids) >= self.max_num_partial_prefills:
            return "full"
        if self.is_long(num_left) and len(self._long_partial_ids) >= self.max_long_partial_prefills:
            return "long"
        return None

    def take_prompt(self, request_id: str, num_new: int, num_computed: int, num_left: int) -> None:
        self._charge(request_id, num_new, True)
        self.num_prompt_tokens_left -= num_new
        if num_new < num_left:
            self._partial_ids.add(request_id)
            if self.is_long(num_left):
                self._long_partial_ids.add(request_id)
        if self.time_budget is not None:
            self.time_budget.take(request_id, num_computed, num_new)

    def take_decode(self, request_id: str, num_computed: int, num_draft_tokens: int = 0) -> None:
        """Charge a decode: its last token and ``num_draft_tokens`` drafts to verify."""
        self._charge(request_id, 1 + num_draft_tokens, False)
        if self.time_budget is not None:
            self.time_budget.add_decode(num_computed)

    def take_tokens(self, request_id: str, num_new: int) -> None:
        """Charge the token budget only (a request resuming from swap)."""
        self._charge(request_id, num_new, False)

    def give_back(self, request_id: str) -> None:
        """Undo ``request_id``'s charges (a decode stays in the time budget's target)."""
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
