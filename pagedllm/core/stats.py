"""Scheduler statistics: one plain snapshot per call of ``Scheduler.get_stats()``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler and its KV cache.

    Block counts partition the pool: ``num_used_blocks + num_free_blocks ==
    num_total_blocks``; ``num_cached_blocks`` is the part of ``num_free_blocks`` that
    still carries a prefix-cache hash (evictable, hits possible). Prefix-cache figures
    are cumulative token counts.
    """

    num_running: int
    num_waiting: int
    num_preemptions: int  # total since start
    kv_cache_usage: float  # num_used_blocks / num_total_blocks, in [0, 1]
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_used_blocks: int  # ref_cnt > 0
    num_cached_blocks: int  # ref_cnt == 0 with a hash
    num_free_blocks: int  # ref_cnt == 0 (cached ones included)
    num_total_blocks: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
