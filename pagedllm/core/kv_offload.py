"""KV offload tiers below the block pool: which block hashes each tier holds (no torch).

A second-tier prefix cache, as LMCache (vLLM's KV connectors) and SGLang's HiCache do:
a full block that the block pool evicts (LRU, to hand its memory to another request) is
first copied to a bounded host-RAM tier and, when a directory is configured, written to
a disk tier. A prefix lookup that misses the pool continues into the tiers (host, then
disk); a hit is copied back into a freshly allocated pool block before the step's
forward pass and counts as cached tokens.

The split (one owner per resource): this module is the *index* — per tier, the map
``block hash → (parent hash, token ids)`` in LRU order, bounded in blocks — and decides
every copy as plain data (:class:`~pagedllm.core.outputs.KVTransferOps` in the
``SchedulerOutput``). The model runner's :mod:`pagedllm.worker.kv_offload` owns the
bytes and performs the copies, at the start of the step, in this order:

1. ``saves``: pool block → tier (the block was evicted in this step's ``schedule()``;
   its new owner writes it only in the forward pass that follows, so the copy reads the
   old K/V).
2. ``loads``: tier → pool block (a block allocated in this step to a request whose
   prefix hit the tier).
3. ``drops``: forget a tier entry (the tier's LRU victim).

Within one step a key that is dropped and then saved again keeps only the save; a key
dropped after a save or a load in the same step is dropped after them, so every load
finds its data. (A tier therefore holds at most its bound plus one step's saves.)

Keys are the chained block hashes of the prefix cache (:func:`hash_block_tokens`). A tier
hit is verified against the stored parent hash and token ids, exactly as a pool hit, so a
hash collision or a corrupted entry never hands a request another prompt's K/V.

Tiers are used for models with a single KV-cache group (no sliding-window layers).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from pagedllm.core.outputs import KVTransferOps, TierSave

TIER_HOST = "host"
TIER_DISK = "disk"
TIERS = (TIER_HOST, TIER_DISK)  # lookup order: the cheaper copy first


@dataclass(frozen=True)
class TierEntry:
    """What a tier stores about one block besides its K/V: the identity a hit is verified with."""

    parent_hash: bytes | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVOffloadSpec:
    """Sizes of the offload tiers as decided at start-up (plain data from the runner).

    Attributes:
        num_host_blocks: blocks the host-RAM tier holds (0: no host tier).
        num_disk_blocks: blocks the disk tier holds (0: no disk tier).
        disk_entries: ``(key, parent hash, token ids)`` of the valid blocks found on
            disk, least recently used first (a restarted engine's disk hits).
    """

    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    disk_entries: tuple[tuple[bytes, bytes | None, tuple[int, ...]], ...] = ()

    @property
    def is_enabled(self) -> bool:
        return self.num_host_blocks > 0 or self.num_disk_blocks > 0


class OffloadTierIndex:
    """The blocks one tier holds, in LRU order (first = evicted next), at most ``num_blocks``.

    Not thread-safe; the scheduler thread owns it.
    """

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
        """Whether the tier holds ``key`` with this parent hash and these token ids (a
        mismatch is a miss). Changes nothing."""
        entry = self.entries.get(key)
        return entry is not None and entry.parent_hash == parent_hash and entry.token_ids == tuple(token_ids)

    def touch(self, key: bytes) -> None:
        """Make ``key`` the most recently used (no-op when absent)."""
        if key in self.entries:
            self.entries.move_to_end(key)

    def add(self, key: bytes, entry: TierEntry) -> list[bytes]:
        """Insert ``key`` as most recently used; returns the keys evicted (LRU) to stay
        within ``num_blocks``."""
        self.entries[key] = entry
        self.entries.move_to_end(key)
        evicted = []
        while len(self.entries) > self.num_blocks:
            evicted.append(self.entries.popitem(last=False)[0])
        return evicted

    def remove(self, key: bytes) -> None:
        self.entries.pop(key, None)


class KVOffloadManager:
    """The tiers' indexes and the copies decided since the last :meth:`take_ops`.

    Args:
        spec: tier sizes and the disk tier's surviving entries.

    Counters (cumulative, blocks): ``num_saved[tier]``, ``num_loaded[tier]``,
    ``num_dropped[tier]``.
    """

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
        disk = self.tiers.get(TIER_DISK)
        for key, parent, tokens in spec.disk_entries if disk is not None else ():
            for victim in disk.add(key, TierEntry(parent, tuple(tokens))):  # over the bound: oldest go
                self._drop(TIER_DISK, victim)

    # ---- the pool's eviction hook --------------------------------------------------------
    def on_evict(self, block_id: int, key: bytes, parent_hash: bytes | None, token_ids: Sequence[int]) -> None:
        """A cached pool block is being evicted: save it to every tier that lacks it
        (write-through, so the disk tier survives a restart), refresh it where present."""
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

    # ---- lookups -------------------------------------------------------------------------
    def find(self, key: bytes, parent_hash: bytes | None, token_ids: Sequence[int]) -> str | None:
        """The first tier (host before disk) holding this verified block, or None."""
        for name, tier in self.tiers.items():
            if tier.lookup(key, parent_hash, token_ids):
                return name
        return None

    def load(self, tier: str, key: bytes, block_id: int) -> None:
        """Copy ``key`` from ``tier`` into pool block ``block_id`` before this step's forward."""
        self.tiers[tier].touch(key)
        self._ops.loads.append((tier, key, block_id))
        self.num_loaded[tier] += 1

    def take_ops(self) -> KVTransferOps:
        """The copies decided since the last call (for this step's SchedulerOutput); resets them."""
        ops, self._ops = self._ops, KVTransferOps()
        ops.drops = [(name, key) for name, keys in self._pending_drops.items() for key in keys]
        for keys in self._pending_drops.values():
            keys.clear()
        return ops

    def num_blocks(self, tier: str) -> int:
        """Blocks ``tier`` holds now (0 for a tier not configured)."""
        return len(self.tiers[tier]) if tier in self.tiers else 0

    def _drop(self, name: str, key: bytes) -> None:
        self._pending_drops[name].add(key)
        self.num_dropped[name] += 1

    def check_integrity(self) -> None:
        """Raise AssertionError unless every tier is within its bound and holds full
        entries of one length."""
        lengths = {len(e.token_ids) for t in self.tiers.values() for e in t.entries.values()}
        assert len(lengths) <= 1, f"tier entries of several lengths: {lengths}"
        for tier in self.tiers.values():
            assert len(tier) <= tier.num_blocks, f"tier {tier.name} holds {len(tier)} > {tier.num_blocks} blocks"


def tier_hit_counts(hits: Iterable[tuple[str, bytes]]) -> dict[str, int]:
    """Blocks per tier in a list of ``(tier, key)`` hits."""
    counts = dict.fromkeys(TIERS, 0)
    for tier, _ in hits:
        counts[tier] += 1
    return counts
