"""Which data-parallel replica serves a request: by prompt prefix, by load, or in turn.

Each replica has its own prefix cache, so a prompt is cheapest where its first blocks were last
computed. Pure Python, no torch: routers run on the event loop and are tested without a model.
The prefix policy and its load cap: docs/engine.md, "Routing".
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, Sequence

from pagedllm.core.block_pool import hash_block_tokens

__all__ = ["ReplicaLoad", "Router", "PrefixAwareRouter", "LeastLoadedRouter", "RoundRobinRouter", "make_router",
           "prefix_block_hashes"]

DEFAULT_MAX_PREFIX_BLOCKS = 64  # a prefix longer than 64 blocks adds nothing to where it should go
DEFAULT_MAX_IMBALANCE = 8  # requests in flight beyond the least loaded replica before a prefix spills over
DEFAULT_MAX_ENTRIES = 1 << 18  # remembered block hashes, least recently used go first


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica's requests in flight and their tokens (prompt + requested output)."""

    num_requests: int
    num_tokens: int


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[bytes]:
    """The prefix cache's chained hashes of the first ``max_blocks`` full blocks (no extra keys)."""
    hashes: list[bytes] = []
    for i in range(min(max_blocks, len(token_ids) // block_size)):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


class Router(Protocol):
    """Chooses a replica for a request. Event-loop thread only."""

    def route(self, token_ids: Sequence[int], loads: Sequence[ReplicaLoad | None]) -> int:
        """The index of the replica to serve a prompt of ``token_ids``; ``loads[i]`` is None when
        replica ``i`` cannot take requests. Raises ValueError when none can."""
        ...


class LeastLoadedRouter:
    """Fewest requests in flight, then fewest tokens in flight; ties taken in turn."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def route(self, token_ids: Sequence[int], loads: Sequence[ReplicaLoad | None]) -> int:
        return self.least_loaded(loads)

    def least_loaded(self, loads: Sequence[ReplicaLoad | None]) -> int:
        available = _available(loads)
        best = min((loads[i].num_requests, loads[i].num_tokens) for i in available)
        tied = [i for i in available if (loads[i].num_requests, loads[i].num_tokens) == best]
        return tied[next(self._turn) % len(tied)]


class RoundRobinRouter:
    """Each available replica in turn, whatever the prompt."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def route(self, token_ids: Sequence[int], loads: Sequence[ReplicaLoad | None]) -> int:
        available = _available(loads)
        return available[next(self._turn) % len(available)]


class PrefixAwareRouter:
    """Route to the replica that last served the longest remembered prefix of the prompt,
    unless it has ``max_imbalance`` more requests in flight than the least loaded one.
    Raises ValueError for a non-positive argument."""

    def __init__(self, block_size: int, *, max_prefix_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS,
                 max_imbalance: int = DEFAULT_MAX_IMBALANCE, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        for name, value in (("block_size", block_size), ("max_prefix_blocks", max_prefix_blocks),
                            ("max_imbalance", max_imbalance), ("max_entries", max_entries)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.max_imbalance = max_imbalance
        self.max_entries = max_entries
        self._owners: OrderedDict[bytes, int] = OrderedDict()  # block hash -> replica that last served it
        self._fallback = LeastLoadedRouter()
        self.num_prefix_routed = 0  # requests sent to their prefix's owner
        self.num_spilled = 0  # requests whose owner was over the load cap

    def route(self, token_ids: Sequence[int], loads: Sequence[ReplicaLoad | None]) -> int:
        hashes = prefix_block_hashes(token_ids, self.block_size, self.max_prefix_blocks)
        owner = self._owner(hashes, loads)
        least = self._fallback.least_loaded(loads)
        if owner is not None and loads[owner].num_requests - loads[least].num_requests < self.max_imbalance:
            choice = owner
            self.num_prefix_routed += 1
        else:
            self.num_spilled += owner is not None
            choice = least
        self._remember(hashes, choice)
        return choice

    def _owner(self, hashes: list[bytes], loads: Sequence[ReplicaLoad | None]) -> int | None:
        for h in reversed(hashes):
            owner = self._owners.get(h)
            if owner is not None and owner < len(loads) and loads[owner] is not None:
                return owner
        return None

    def _remember(self, hashes: list[bytes], replica: int) -> None:
        for h in hashes:
            self._owners[h] = replica
            self._owners.move_to_end(h)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)

    def forget(self, replica: int) -> None:
        """Drop every prefix owned by ``replica`` (it died: its cache is gone)."""
        for h in [h for h, r in self._owners.items() if r == replica]:
            del self._owners[h]


def make_router(policy: str, block_size: int) -> Router:
    """The router ``data_parallel_router`` names; ValueError naming it for an unknown one."""
    if policy == "prefix":
        return PrefixAwareRouter(block_size)
    if policy == "least_loaded":
        return LeastLoadedRouter()
    if policy == "round_robin":
        return RoundRobinRouter()
    raise ValueError(f"data_parallel_router must be prefix, least_loaded or round_robin, got {policy!r}")


def _available(loads: Sequence[ReplicaLoad | None]) -> list[int]:
    available = [i for i, load in enumerate(loads) if load is not None]
    if not available:
        raise ValueError("no data-parallel replica can take requests")
    return available
