"""BlockPool: the physical KV blocks (one pool for all layers), their reference counts, the free
queue (which is also the eviction order) and the prefix cache (block hash → block)."""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Callable, Iterable, Iterator, Sequence

from pagedllm.config import validate_block_size

# Parent of every sequence's first block: fixed, so hashes agree across runs and processes.
ROOT_BLOCK_HASH = hashlib.sha256(b"pagedllm-prefix-cache-root").digest()
_BIG_ENDIAN = sys.byteorder == "big"


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> bytes:
    """SHA-256 of ``parent ‖ int64 LE token ids ‖ repr(extra_keys)`` (vLLM's chained hash; parent
    None: the first block; extra keys: cache salt, LoRA id)."""
    h = hashlib.sha256(ROOT_BLOCK_HASH if parent_hash is None else parent_hash)
    ids = array("q", token_ids)  # full width: ids 65 and 321 never collide
    if _BIG_ENDIAN:
        ids.byteswap()
    h.update(ids.tobytes())
    if extra_keys:
        h.update(b"\x00extra:")
        h.update(repr(extra_keys).encode())
    return h.digest()


class KVCacheBlock:

    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.parent_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked free blocks, O(1) anywhere (a hit takes one out); the head goes next."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVCacheBlock) -> None:
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._link(block, self._head, self._head.next_free)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]

    def _link(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1


class BlockPool:
    """All physical KV blocks; one scheduler thread owns it. ``reserve_null_block`` keeps block 0
    out as :attr:`null_block` (vLLM's), where sliding tables point at freed blocks. ValueError
    naming the argument for a bad ``num_blocks`` or ``block_size``."""

    # Which of a request's blocks are shared, cached or freeable (block_size 4, 10 tokens,
    # the first block shared with an earlier request):
    #
    #   block table    [ 7 ][ 3 ][ 9 ]
    #   tokens          0-3  4-7  8-9   (partial tail: never hashed, still growing)
    #   hash            h0   h1   -     h_i = H(h_{i-1}, tokens of block i, extra keys)
    #   ref_cnt         2    1    1
    #   after free      7: ref 1, still in use
    #                   3: free queue tail, cached (h1 kept: a later prompt may hit it)
    #                   9: free queue head, no hash (reused first, before any eviction)
    #
    # An allocation takes the free queue's head; taking a hashed block evicts it (drops h).

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 reserve_null_block: bool = False) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1 + reserve_null_block:
            raise ValueError(f"num_blocks must be an integer >= {1 + reserve_null_block}, got {num_blocks!r}")
        validate_block_size(block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = self.blocks[0] if reserve_null_block else None
        self.free_block_queue = FreeBlockQueue(self.blocks[1:] if reserve_null_block else self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.num_used_blocks = 0  # ref_cnt > 0
        self.num_cached_free_blocks = 0  # ref_cnt == 0, hashed
        self.num_evicted_blocks = 0
        # on_evict(block_id, hash, parent_hash, token_ids): just before an eviction (offload tiers)
        self.on_evict: Callable[[int, bytes, bytes | None, tuple[int, ...]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.num_blocks - (self.null_block is not None)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks

    def get_cached_block(self, block_hash: bytes, parent_hash: bytes | None,
                         token_ids: Sequence[int]) -> KVCacheBlock | None:
        """The block published under ``block_hash`` with this parent and tokens, else None (no ref)."""
        block = self.cached_block_hash_to_block.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes, parent_hash: bytes | None,
                         token_ids: Sequence[int]) -> bool:
        """Publish a full, computed, in-use block; False if caching is off or the hash is taken."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached_block_hash_to_block:
            return False
        if block.ref_cnt == 0:
            raise ValueError(f"block {block.block_id} is free; only blocks in use can be published")
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; only while no block is in use (else False, nothing changed)."""
        if self.num_used_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            self._drop_hash(block)
        self.cached_block_hash_to_block.clear()
        self.num_cached_free_blocks = 0
        return True

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """``num_blocks`` blocks from the queue's head (evicted), ref_cnt 1; ValueError if short."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, only {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash, block.parent_hash, block.token_ids)
                del self.cached_block_hash_to_block[block.block_hash]
                self._drop_hash(block)
                self.num_cached_free_blocks -= 1
                self.num_evicted_blocks += 1
            block.ref_cnt = 1
            new_blocks.append(block)
        self.num_used_blocks += num_blocks
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                self.num_used_blocks += 1
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; hashed ones join the queue's tail in this order
        (first freed, first evicted), others its head. ValueError on a free block."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.num_used_blocks -= 1
                if block.block_hash is not None:
                    self.free_block_queue.append(block)
                    self.num_cached_free_blocks += 1
                else:
                    self.free_block_queue.appendleft(block)

    def block_states(self) -> str:
        """One character per block id: ``0`` free, ``1`` cached (free, hashed), ``2`` in use,
        ``3`` shared (ref_cnt > 1), ``4`` the null block."""
        states = ["2" if b.ref_cnt == 1 else "3" if b.ref_cnt else "0" if b.block_hash is None else "1"
                  for b in self.blocks]
        if self.null_block is not None:
            states[self.null_block.block_id] = "4"
        return "".join(states)

    @staticmethod
    def _drop_hash(block: KVCacheBlock) -> None:
        block.block_hash = block.parent_hash = block.token_ids = None

    def check_integrity(self) -> None:
        """AssertionError unless the queue, the hash map and the counters agree with the blocks."""
        free_ids = self.free_block_queue.block_ids()
        free_set = set(free_ids)
        assert len(free_set) == len(free_ids), "a block is twice in the free queue"
        assert len(free_ids) == self.free_block_queue.num_free_blocks, "free-queue count is off"
        num_used = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            if block is self.null_block:
                assert block.ref_cnt == 0 and block.block_hash is None and block.block_id not in free_set, \
                    "the null block was handed out, referenced or published"
                continue
            if block.block_id in free_set:
                assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            else:
                assert block.ref_cnt > 0, f"block {block.block_id} is neither free nor referenced"
                num_used += 1
            if block.block_hash is not None:
                assert self.enable_caching, "a hash is stored with caching off"
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, \
                    f"block {block.block_id} carries a hash the map does not point back from"
                assert block.token_ids is not None and len(block.token_ids) == self.block_size, \
                    f"published block {block.block_id} is not full"
        for h, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == h, f"map entry points at block {block.block_id} with another hash"
        assert num_used + len(free_ids) + (self.null_block is not None) == self.num_blocks, "free + in use != total"
        assert num_used == self.num_used_blocks, "num_used_blocks counter is off"
        assert self.num_cached_free_blocks == sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash), \
            "num_cached_free_blocks counter is off"
