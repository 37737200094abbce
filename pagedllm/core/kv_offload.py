"""KV offload tiers below the pool (as LMCache, SGLang's HiCache): which block hashes each holds.
Evicted blocks are saved to host RAM (and disk); a pool miss continues there. The copies are
plain data, done by :mod:`pagedllm.worker.kv_offload` before the forward: ``saves`` (evicted in
this ``schedule()``, rewritten only in the forward), ``loads``, ``drops``. One KV-cache group only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from pagedllm.core.outputs import KVTransferOps, TierSave

TIER_HOST = "host"
TIER_DISK = "disk"
TIERS = (TIER_HOST, TIER_DISK)  # lookup order


@dataclass(frozen=True)
class TierEntry:
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVOffloadSpec:
    """Tier sizes in blocks (0: none) and the ``(key, parent hash, token ids)`` of the valid
    blocks found on disk at start-up, least recently used first."""

    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    disk_entries: tuple[tuple[bytes, bytes | None, tuple[int, ...]], ...] = ()

    @property
    def is_enabled(self) -> bool:
        return self.num_host_blocks > 0 or self.num_disk_blocks > 0


class OffloadTierIndex:
    """The blocks one tier holds, least recently used first, at most ``num_blocks``."""

    def __init__(self, name: str, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks of tier {name!r} must be a positive integer, got {num_blocks!r}")
        self.name = name
        self.num_blocks = num_blocks
        self.entries: OrderedDict[bytes, TierEntry] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, key: bytes, parent_hash: bytes | None, token_ids: Sequence[int]) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.parent_hash == parent_hash and entry.token_ids == tuple(token_ids)

    def touch(self, key: bytes) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)

    def add(self, key: bytes, entry: TierEntry) -> list[bytes]:
        """Insert ``key`` as most recent; returns the keys evicted to stay within the bound."""
        self.entries[key] = entry
        self.entries.move_to_end(key)
        evicted = []
        while len(self.entries) > self.num_blocks:
            evicted.append(self.entries.popitem(last=False)[0])
        return evicted

    def remove(self, key: bytes) -> None:
        self.entries.pop(key, None)


class KVOffloadManager:
    """The tiers' indexes, the copies decided since :meth:`take_ops`, cumulative block counters."""

    def __init__(self, spec: KVOffloadSpec) -> None:
        self.tiers: dict[str, OffloadTierIndex] = {}
        if spec.num_host_blocks:
            self.tiers[TIER_HOST] = OffloadTierIndex(TIER_HOST, spec.num_host_blocks)
        if spec.num_disk_blocks:
            self.tiers[TIER_DISK] = OffloadTierIndex(TIER_DISK, spec.num_disk_blocks)
        self._ops = KVTransferOps()
        self._pending_drops: dict[str, set[bytes]] = {name: set() for name in self.tiers}
        self.num_saved = dict.fromkeys(self.tiers, 0)
        self.num_loaded = dict.fromkeys(self.tiers, 0)
        self.num_dropped = dict.fromkeys(self.tiers, 0)
        self.num_errors = dict.fromkeys(self.tiers, 0)
        disk = self.tiers.get(TIER_DISK)
        for key, parent, tokens in spec.disk_entries if disk is not None else ():
            for victim in disk.add(key, TierEntry(parent, tuple(tokens))):
                self._drop(TIER_DISK, victim)

    def on_evict(self, block_id: int, key: bytes, parent_hash: bytes | None, token_ids: Sequence[int]) -> None:
        """The pool's eviction hook: save to every tier lacking the block (write-through, so disk
        survives a restart), refresh it elsewhere."""
        entry = TierEntry(parent_hash, tuple(token_ids))
        for name, tier in self.tiers.items():
            if key in tier:
                tier.touch(key)
                continue
            self._pending_drops[name].discard(key)  # dropped earlier this step: the save wins
            self._ops.saves.append(TierSave(name, key, block_id, parent_hash, entry.token_ids))
            self.num_saved[name] += 1
            for victim in tier.add(key, entry):
                self._drop(name, victim)

    def find(self, key: bytes, parent_hash: bytes | None, token_ids: Sequence[int]) -> str | None:
        for name, tier in self.tiers.items():
            if tier.lookup(key, parent_hash, token_ids):
                return name
        return None

    def load(self, tier: str, key: bytes, block_id: int) -> None:
        self.tiers[tier].touch(key)
        self._ops.loads.append((tier, key, block_id))
        self.num_loaded[tier] += 1

    def forget(self, keys: Iterable[tuple[str, bytes]]) -> None:
        """Blocks a tier could not store or read: out of its index (each an I/O error, counted)."""
        for name, key in keys:
            if name in self.tiers:
                self.tiers[name].remove(key)
                self.num_errors[name] += 1

    def take_ops(self) -> KVTransferOps:
        """The copies decided since the last call; resets them."""
        ops, self._ops = self._ops, KVTransferOps()
        ops.drops = [(name, key) for name, keys in self._pending_drops.items() for key in keys]
        for keys in self._pending_drops.values():
            keys.clear()
        return ops

    def num_blocks(self, tier: str) -> int:
        return len(self.tiers[tier]) if tier in self.tiers else 0

    def _drop(self, name: str, key: bytes) -> None:
        self._pending_drops[name].add(key)
        self.num_dropped[name] += 1

    def check_integrity(self) -> None:
        lengths = {len(e.token_ids) for t in self.tiers.values() for e in t.entries.values()}
        assert len(lengths) <= 1, f"tier entries of several lengths: {lengths}"
        for tier in self.tiers.values():
            assert len(tier) <= tier.num_blocks, f"tier {tier.name} holds {len(tier)} > {tier.num_blocks} blocks"


def tier_hit_counts(hits: Iterable[tuple[str, bytes]]) -> dict[str, int]:
    counts = dict.fromkeys(TIERS, 0)
    for tier, _ in hits:
        counts[tier] += 1
    return counts
