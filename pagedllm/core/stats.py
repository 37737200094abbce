"""SchedulerStats: one plain snapshot per ``Scheduler.get_stats()``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    """Used + free blocks == total; cached blocks are free ones still hashed. Cumulative tokens."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_usage: float  # in [0, 1]
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_used_blocks: int
    num_cached_blocks: int
    num_free_blocks: int
    num_total_blocks: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
