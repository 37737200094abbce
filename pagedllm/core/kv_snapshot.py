"""A point-in-time picture of the KV cache for the live map (``GET /kv/state``).

Taken on the engine thread between steps (``LLMEngine.kv_cache_snapshot()``), so every
count is consistent; plain data only (ints, strings, lists), O(blocks + requests) to
build. The server turns it into JSON and knows nothing of blocks beyond it.

Block states, one character per block in block-id order (:data:`BLOCK_STATES`):

* ``0`` free: ref_cnt 0, no hash (handed out first);
* ``1`` cached: ref_cnt 0, still carrying a prefix-cache hash (a later request can hit
  it; evicted in LRU order when blocks run out);
* ``2`` in use: held by exactly one block table;
* ``3`` shared: held by several block tables (a common prefix, ``n > 1`` siblings);
* ``4`` null: the hybrid pool's reserved null block (block 0 when the model has
  sliding-window layers), which freed out-of-window table entries point at.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

BLOCK_STATES = {"0": "free", "1": "cached", "2": "used", "3": "shared", "4": "null"}

# Kinds of KVEvent.
EVENT_PREFIX_HIT = "prefix_hit"  # admitted with cached (or sibling-shared) blocks
EVENT_EVICTED = "evicted"  # an allocation for this request dropped cached blocks
EVENT_PREEMPTED = "preempted"  # blocks freed to make room; recomputed later
EVENT_RESUMED = "resumed"  # a preempted request admitted again


@dataclass(frozen=True)
class KVEvent:
    """One preemption / caching event of one request. ``time`` in seconds (``time.time()``)."""

    time: float
    kind: str
    request_id: str
    num_blocks: int  # blocks hit, evicted, freed or (resumed) held after admission
    num_tokens: int  # tokens they cover (preempted: computed tokens lost)


class KVEventLog:
    """The last ``maxlen`` events, oldest first. Appending is O(1); the scheduler owns it."""

    def __init__(self, maxlen: int = 100) -> None:
        self.events: deque[KVEvent] = deque(maxlen=maxlen)

    def record(self, kind: str, request_id: str, num_blocks: int, num_tokens: int) -> None:
        self.events.append(KVEvent(time.time(), kind, request_id, num_blocks, num_tokens))


@dataclass(frozen=True)
class RequestKVRow:
    """One unfinished request's place in the cache. Token counts in tokens."""

    request_id: str
    status: str  # "running", "waiting" or "preempted" (waiting after a preemption)
    block_ids: list[int]  # the physical blocks it holds, all groups (null entries left out; [] while waiting)
    block_tables: list[list[int]]  # one block table per KV-cache group, logical order, null ids included
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int  # tokens whose K/V is in the cache
    num_cached_tokens: int  # prompt tokens served from the prefix cache at its last admission
    num_preemptions: int


@dataclass(frozen=True)
class KVCacheSnapshot:
    """The whole pool and every unfinished request at one instant between two steps.

    ``block_states`` has one character per block (see the module docstring); the five
    ``num_*_blocks`` counts partition ``num_blocks``. Counters are cumulative since start.
    ``kv_cache_groups``: per group, its ``layer_ids`` and ``sliding_window`` (None = full).
    """

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
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_evicted_blocks: int
    num_preemptions: int
    num_running: int
    num_waiting: int
    kv_cache_groups: list[dict] = field(default_factory=list)
    requests: list[RequestKVRow] = field(default_factory=list)
    events: list[KVEvent] = field(default_factory=list)

    @classmethod
    def from_states(cls, block_states: str, **fields) -> "KVCacheSnapshot":
        """Build it from the state string, counting each state (C-speed ``str.count``)."""
        return cls(block_states=block_states, num_blocks=len(block_states),
                   num_free_blocks=block_states.count("0"), num_cached_blocks=block_states.count("1"),
                   num_used_blocks=block_states.count("2"), num_shared_blocks=block_states.count("3"),
                   num_null_blocks=block_states.count("4"), **fields)

    def to_dict(self) -> dict:
        """JSON-ready (what ``GET /kv/state`` returns)."""
        return dataclasses.asdict(self)
