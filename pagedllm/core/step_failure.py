"""Step failures that name their requests: only those end; the rest of the step runs again next step."""

from __future__ import annotations

from dataclasses import dataclass, field


class InputError(str):
    """An error message caused by the request's own input: the server answers it with HTTP 400."""


@dataclass
class StepFailure(Exception):
    """``failed``: request id -> message; ``failed_loads``: ``(tier, key, block_id)`` tier reads that
    failed (the requests holding those blocks are computed again)."""

    failed: dict[str, str] = field(default_factory=dict)
    failed_loads: list[tuple[str, bytes, int]] = field(default_factory=list)

    def __str__(self) -> str:
        return f"step failed for {sorted(self.failed)}; {len(self.failed_loads)} tier loads failed"


def positions_beyond(num_computed: dict[str, int], num_scheduled: dict[str, int],
                     max_positions: int) -> dict[str, str]:
    """Requests whose last position this step is not below ``max_positions``: id -> InputError."""
    return {rid: InputError(f"the sequence reaches position {num_computed[rid] + n - 1}, beyond the "
                            f"{max_positions} positions the model computes")
            for rid, n in num_scheduled.items() if num_computed[rid] + n > max_positions}
