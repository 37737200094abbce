"""Swap space: a bounded secondary pool that holds preempted requests' blocks (no torch).

Swap preemption (vLLM v0's ``preemption_mode="swap"``): instead of freeing a victim's
K/V and recomputing it on resumption, its blocks are copied to a secondary pool of
``swap_space`` bytes (host memory) and copied back into fresh pool blocks when it is
admitted again, so it resumes where it stopped. This module is the index — which swap
slots are free, which request holds which — and the cost rule of ``preemption_mode =
"auto"``; the runner's :mod:`pagedllm.worker.kv_offload` owns the bytes and performs the
copies (``swap_out`` before anything writes the pool, ``swap_in`` into blocks allocated
this step, see :class:`~pagedllm.core.outputs.KVTransferOps`).

Auto by cost, per victim: recompute costs ``tokens to recompute × prefill seconds per
token`` (measured by the engine on its own prefill steps); swap costs ``2 × bytes of its
blocks ÷ copy bandwidth`` (out and back in; bandwidth measured by the runner at start).
Swap when it is cheaper and the swap space has room; recompute otherwise — and whenever
the swap space is full (``swap`` falls back to recompute too).
"""

from __future__ import annotations

from dataclasses import dataclass

PREEMPT_RECOMPUTE = "recompute"
PREEMPT_SWAP = "swap"
PREEMPTION_MODES = (PREEMPT_RECOMPUTE, PREEMPT_SWAP, "auto")


@dataclass
class SwapRecord:
    """A swapped-out request: its swap slots in block-table order, and how many of its
    tokens' K/V they hold."""

    slots: list[int]
    num_computed_tokens: int


class SwapSpace:
    """Swap slots (one block each), the requests holding them, and the auto-mode costs.

    Args:
        num_blocks: slots in the swap space (0: swapping never possible).
        mode: ``recompute``, ``swap`` or ``auto``.
        bytes_per_block: bytes one block copies (every KV tensor).
        copy_bytes_per_s: measured copy bandwidth between the pool and the swap space.

    Raises:
        ValueError: an unknown ``mode`` or a negative ``num_blocks``.
    """

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
        self.prefill_s_per_token: float | None = None  # measured by the engine; None until then
        self._free_slots = list(range(num_blocks - 1, -1, -1))  # pop() hands out slot 0 first
        self.swapped: dict[str, SwapRecord] = {}
        self.num_swapped_out = 0  # cumulative requests
        self.num_fallbacks = 0  # swaps wanted but the space was full

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_slots)

    def observe_prefill(self, seconds: float, num_tokens: int) -> None:
        """Record a prefill step's cost (exponential moving average, weight 0.2)."""
        if num_tokens <= 0 or seconds <= 0:
            return
        cost = seconds / num_tokens
        prev = self.prefill_s_per_token
        self.prefill_s_per_token = cost if prev is None else 0.8 * prev + 0.2 * cost

    def choose_mode(self, num_computed_tokens: int, num_blocks: int) -> str:
        """How to preempt a victim holding ``num_blocks`` blocks for ``num_computed_tokens``
        computed tokens: ``swap`` or ``recompute`` (see the module docstring)."""
        if self.mode == PREEMPT_RECOMPUTE or num_computed_tokens == 0:
            return PREEMPT_RECOMPUTE
        if num_blocks > self.num_free_blocks:
            self.num_fallbacks += 1
            return PREEMPT_RECOMPUTE
        if self.mode == PREEMPT_SWAP:
            return PREEMPT_SWAP
        if self.prefill_s_per_token is None or self.copy_bytes_per_s <= 0:
            return PREEMPT_RECOMPUTE  # nothing measured yet: the safe default
        recompute_s = num_computed_tokens * self.prefill_s_per_token
        swap_s = 2 * num_blocks * self.bytes_per_block / self.copy_bytes_per_s
        return PREEMPT_SWAP if swap_s < recompute_s else PREEMPT_RECOMPUTE

    def swap_out(self, request_id: str, num_blocks: int, num_computed_tokens: int) -> list[int]:
        """Reserve ``num_blocks`` slots for ``request_id``; returns them. Raises ValueError
        when fewer are free or the request already holds slots."""
        if request_id in self.swapped:
            raise ValueError(f"request {request_id!r} is already swapped out")
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot swap out {num_blocks} blocks, only {self.num_free_blocks} slots free")
        slots = [self._free_slots.pop() for _ in range(num_blocks)]
        self.swapped[request_id] = SwapRecord(slots, num_computed_tokens)
        self.num_swapped_out += 1
        return slots

    def release(self, request_id: str) -> SwapRecord | None:
        """Give ``request_id``'s slots back (swapped in, or finished/aborted while out);
        returns its record, None if it held none. Idempotent."""
        record = self.swapped.pop(request_id, None)
        if record is not None:
            self._free_slots.extend(reversed(record.slots))
        return record

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + held slots == total, each exactly once."""
        held = [s for r in self.swapped.values() for s in r.slots]
        every = sorted(held + self._free_slots)
        assert every == list(range(self.num_blocks)), "swap slots leaked or held twice"
