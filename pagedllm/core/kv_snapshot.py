"""A point-in-time picture of the KV cache for the live map (``GET /kv/state``): plain data, taken
between steps; ``block_states`` has one character per block id (:data:`BLOCK_STATES`)."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

BLOCK_STATES = {"0": "free", "1": "cached", "2": "used", "3": "shared", "4": "null"}

EVENT_PREFIX_HIT = "prefix_hit"
EVENT_EVICTED = "evicted"  # an allocation for this request dropped cached blocks
EVENT_PREEMPTED = "preempted"
EVENT_RESUMED = "resumed"


@dataclass(frozen=True)
class KVEvent:

    time: float
    kind: str
    request_id: str
    num_blocks: int  # hit, evicted, freed, or held after resumption
    num_tokens: int


class KVEventLog:

    def __init__(self, maxlen: int = 100) -> None:
        self.events: deque[KVEvent] = deque(maxlen=maxlen)

    def record(self, kind: str, request_id: str, num_blocks: int, num_tokens: int) -> None:
        self.events.append(KVEvent(time.time(), kind, request_id, num_blocks, num_tokens))


@dataclass(frozen=True)
class RequestKVRow:
    request_id: str
    status: str  # "running", "waiting" or "preempted"
    block_ids: list[int]  # held, all groups, no null entries
    block_tables: list[list[int]]  # per KV-cache group
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int  # at its last admission
    num_preemptions: int


@dataclass(frozen=True)
class KVCacheSnapshot:
    """The pool and every unfinished request between two steps; counters cumulative since start."""

    time: float
    num_steps: int
    num_blocks: int
    block_size: int
    block_states: str
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int
    num_shared_blocks: int
    num_null_blocks: int
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int
    num_evicted_blocks: int
    num_preemptions: int
    num_running: int
    num_waiting: int
    kv_cache_groups: list[dict] = field(default_factory=list)
    requests: list[RequestKVRow] = field(default_factory=list)
    events: list[KVEvent] = field(default_factory=list)

    @classmethod
    def from_states(cls, block_states: str, **fields) -> "KVCacheSnapshot":
        return cls(block_states=block_states, num_blocks=len(block_states),
                   num_free_blocks=block_states.count("0"), num_cached_blocks=block_states.count("1"),
                   num_used_blocks=block_states.count("2"), num_shared_blocks=block_states.count("3"),
                   num_null_blocks=block_states.count("4"), **fields)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
