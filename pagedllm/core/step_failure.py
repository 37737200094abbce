"""Step failures that name their requests, so that only those requests end with an error.

A runner or engine check that knows which request caused a failure raises :class:`StepFailure`;
the engine ends the named requests and runs every other scheduled request again the next step,
from the state it had before the failed step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class InputError(str):
    """An error message caused by the request's own input: the server answers it with HTTP 400."""


@dataclass
class StepFailure(Exception):
    """``failed``: request id -> message (an :class:`InputError` where the input caused it).
    ``failed_loads``: ``(tier, key, block_id)`` tier reads that failed; the requests holding
    those blocks lose their KV and are computed again, the tier forgets the keys."""

    failed: dict[str, str] = field(default_factory=dict)
    failed_loads: list[tuple[str, bytes, int]] = field(default_factory=list)

    def __str__(self) -> str:
        return f"step failed for {sorted(self.failed)}; {len(self.failed_loads)} tier loads failed"


def positions_beyond(num_computed: dict[str, int], num_scheduled: dict[str, int],
                     max_positions: int) -> dict[str, str]:
    """Requests whose last position this step, ``num_computed + num_scheduled - 1``, is not below
    ``max_positions`` (the rotary table's rows), as request id -> :class:`InputError`."""
    return {rid: InputError(f"the sequence reaches position {num_computed[rid] + n - 1}, beyond the "
                            f"{max_positions} positions the model computes")
            for rid, n in num_scheduled.items() if num_computed[rid] + n > max_positions}
