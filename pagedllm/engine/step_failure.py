"""A step without some requests, and the output of a step that ran none of its requests."""

from __future__ import annotations

import dataclasses

from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput


def without_requests(so: SchedulerOutput, request_ids) -> SchedulerOutput:
    """A copy of the step that runs none of ``request_ids`` (the runner never sees them)."""
    drop = set(request_ids)
    num_scheduled = {r: n for r, n in so.num_scheduled_tokens.items() if r not in drop}
    return dataclasses.replace(
        so, num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_new_reqs=[r for r in so.scheduled_new_reqs if r.req_id not in drop],
        scheduled_cached_reqs=[r for r in so.scheduled_cached_reqs if r.req_id not in drop])


def retry_output(so: SchedulerOutput, failed: dict[str, str], recomputed: list[str]) -> ModelRunnerOutput:
    """The output of a step that did not run: ``failed`` end with their errors, ``recomputed`` were
    preempted by the scheduler, every other scheduled request is retried."""
    skip = set(failed) | set(recomputed)
    return ModelRunnerOutput(failed=dict(failed), retried={r for r in so.num_scheduled_tokens if r not in skip})
