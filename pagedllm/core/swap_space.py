"""Swap space (vLLM v0's swap preemption): which host slots hold which preempted request's blocks,
and the ``auto`` rule: swap when ``2 x block bytes / copy bandwidth`` beats recomputing ``tokens x
prefill seconds per token`` and there is room, else recompute (``swap`` too, when full)."""

from __future__ import annotations

from dataclasses import dataclass

PREEMPT_RECOMPUTE = "recompute"
PREEMPT_SWAP = "swap"
PREEMPTION_MODES = (PREEMPT_RECOMPUTE, PREEMPT_SWAP, "auto")


@dataclass
class SwapRecord:
    slots: list[int]
    num_computed_tokens: int


class SwapSpace:
    """Swap slots (one block each, block-table order per request) and the auto-mode costs.
    ValueError for an unknown ``mode`` or a negative ``num_blocks``."""

    def __init__(self, num_blocks: int, mode: str = PREEMPT_RECOMPUTE, bytes_per_block: int = 0,
                 copy_bytes_per_s: float = 0.0) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {mode!r}")
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.mode = mode
        self.bytes_per_block = bytes_per_block
        self.copy_bytes_per_s = copy_bytes_per_s
        self.prefill_s_per_token: float | None = None  # measured by the engine
        self._free_slots = list(range(num_blocks - 1, -1, -1))  # slot 0 first
        self.swapped: dict[str, SwapRecord] = {}
        self.num_swapped_out = 0
        self.num_fallbacks = 0  # swaps wanted, space full

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_slots)

    def observe_prefill(self, seconds: float, num_tokens: int) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        cost = seconds / num_tokens
        prev = self.prefill_s_per_token
        self.prefill_s_per_token = cost if prev is None else 0.8 * prev + 0.2 * cost

    def choose_mode(self, num_computed_tokens: int, num_blocks: int) -> str:
        if self.mode == PREEMPT_RECOMPUTE or num_computed_tokens == 0:
            return PREEMPT_RECOMPUTE
        if num_blocks > self.num_free_blocks:
            self.num_fallbacks += 1
            return PREEMPT_RECOMPUTE
        if self.mode == PREEMPT_SWAP:
            return PREEMPT_SWAP
        if self.prefill_s_per_token is None or self.copy_bytes_per_s <= 0:
            return PREEMPT_RECOMPUTE  # nothing measured yet
        recompute_s = num_computed_tokens * self.prefill_s_per_token
        swap_s = 2 * num_blocks * self.bytes_per_block / self.copy_bytes_per_s
        return PREEMPT_SWAP if swap_s < recompute_s else PREEMPT_RECOMPUTE

    def swap_out(self, request_id: str, num_blocks: int, num_computed_tokens: int) -> list[int]:
        """Reserve and return ``num_blocks`` slots; ValueError when short or already swapped out."""
        if request_id in self.swapped:
            raise ValueError(f"request {request_id!r} is already swapped out")
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot swap out {num_blocks} blocks, only {self.num_free_blocks} slots free")
        slots = [self._free_slots.pop() for _ in range(num_blocks)]
        self.swapped[request_id] = SwapRecord(slots, num_computed_tokens)
        self.num_swapped_out += 1
        return slots

    def release(self, request_id: str) -> SwapRecord | None:
        """Free ``request_id``'s slots; returns its record (None if none). Idempotent."""
        record = self.swapped.pop(request_id, None)
        if record is not None:
            self._free_slots.extend(reversed(record.slots))
        return record

    def check_integrity(self) -> None:
        held = [s for r in self.swapped.values() for s in r.slots]
        every = sorted(held + self._free_slots)
        assert every == list(range(self.num_blocks)), "swap slots leaked or held twice"
