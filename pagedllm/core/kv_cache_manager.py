"""KVCacheManager: per-request block tables (one per KV-cache group, all one length) on the
block pool; the scheduler's only door to memory. Blocks are published after the step that
computed them, not at scheduling as in vLLM, so no same-step admission can hit unwritten K/V."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from pagedllm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.core.kv_cache_groups import KVCacheGroupSpec, cdiv, max_num_blocks_per_seq
from pagedllm.core.kv_offload import KVOffloadManager, KVOffloadSpec
from pagedllm.core.request import Request

GroupBlockIds = tuple[list[int], ...]  # entry g: group g's block ids
TierHit = tuple[str, bytes]  # (tier name, block hash)


def _from_pool(name: str) -> property:
    return property(lambda self: getattr(self.block_pool, name))


class KVCacheManager:
    """Block tables, prefix-cache lookups, slot allocation and release. ``kv_cache_groups``
    default: one full-attention group; ``kv_offload`` is used only with caching and one group.
    ValueError naming the argument."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, max_model_len: int,
                 kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
                 kv_offload: KVOffloadSpec | None = None) -> None:
        if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        groups = tuple(kv_cache_groups) if kv_cache_groups is not None else (KVCacheGroupSpec((), None),)
        if not groups:
            raise ValueError("kv_cache_groups must hold at least one group")
        self.kv_cache_groups = groups
        self.num_groups = len(groups)
        self._sliding = [(g, spec.sliding_window) for g, spec in enumerate(groups) if spec.sliding_window]
        self.block_pool = BlockPool(num_blocks, block_size, enable_prefix_caching,
                                    reserve_null_block=bool(self._sliding))
        self.null_block = self.block_pool.null_block
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self.req_to_blocks: dict[str, tuple[list[KVCacheBlock], ...]] = {}
        self._num_handled_blocks: dict[str, int] = {}  # blocks cache_blocks has seen
        self.prefix_cache_queries = 0  # tokens, counted once per admission
        self.prefix_cache_hits = 0
        self.num_window_freed_blocks = 0
        self.offload: KVOffloadManager | None = None
        if kv_offload is not None and kv_offload.is_enabled and enable_prefix_caching and self.num_groups == 1:
            self.offload = KVOffloadManager(kv_offload)
            self.block_pool.on_evict = self.offload.on_evict

    num_total_blocks = _from_pool("num_total_blocks")
    num_used_blocks = _from_pool("num_used_blocks")
    num_free_or_evictable_blocks = _from_pool("num_free_blocks")
    num_cached_free_blocks = _from_pool("num_cached_free_blocks")
    num_evicted_blocks = _from_pool("num_evicted_blocks")
    usage = _from_pool("usage")

    def block_states(self) -> str:
        return self.block_pool.block_states()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def max_num_blocks_per_seq(self, num_tokens: int, max_chunk_tokens: int) -> int:
        return max_num_blocks_per_seq(self.kv_cache_groups, num_tokens, self.block_size, max_chunk_tokens)

    def can_use_prefix_cache(self, request: Request) -> bool:
        """Caching on, and no prompt logprobs (cached positions produce no logits)."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlockIds, int]:
        """(block ids per group, tokens): the longest cached prefix every group can continue from
        (vLLM's hybrid coordinator), one token left. Changes only ``request.block_hashes``."""
        empty = tuple([] for _ in self.kv_cache_groups)
        if not self.can_use_prefix_cache(request):
            return empty, 0
        num_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, num_blocks)
        hits: list[list[KVCacheBlock]] = [[] for _ in self.kv_cache_groups]
        is_settled = False
        while not is_settled and num_blocks > 0:  # lower the length until every group agrees
            is_settled = True
            for g in range(self.num_groups):
                hits[g] = self._find_hit(request, hashes, g, num_blocks)
                if len(hits[g]) < num_blocks:
                    num_blocks, is_settled = len(hits[g]), False
        if num_blocks == 0:
            return empty, 0
        return tuple([b.block_id for b in hit[:num_blocks]] for hit in hits), num_blocks * self.block_size

    def get_shared_prefix_blocks(self, request: Request, donor: Request) -> tuple[GroupBlockIds, int]:
        """(block ids per group, tokens): full prompt blocks shared with sibling ``donor``."""
        empty = tuple([] for _ in self.kv_cache_groups)
        donor_blocks = self.req_to_blocks.get(donor.request_id)
        if not donor_blocks or request.sampling_params.prompt_logprobs is not None:
            return empty, 0
        num_tokens = min(donor.num_computed_tokens, request.num_prompt_tokens, request.num_tokens - 1)
        num_blocks = min(num_tokens // self.block_size, len(donor_blocks[0]))
        n = num_blocks * self.block_size
        if num_blocks == 0 or request.prompt_token_ids[:n] != donor.prompt_token_ids[:n]:
            return empty, 0
        for g, window in self._sliding:
            first_needed = max(0, n - window + 1) // self.block_size
            if any(b is self.null_block for b in donor_blocks[g][first_needed:num_blocks]):
                return empty, 0
        return tuple([b.block_id for b in blocks[:num_blocks]] for blocks in donor_blocks), n

    def get_tier_hits(self, request: Request, num_pool_blocks: int) -> list[TierHit]:
        """The run of blocks after the pool's hit that the offload tiers hold. Changes nothing."""
        if self.offload is None or not self.can_use_prefix_cache(request):
            return []
        num_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, num_blocks)
        tokens, bs, hits = request.all_token_ids, self.block_size, []
        for i in range(num_pool_blocks, num_blocks):
            tier = self.offload.find(hashes[i], hashes[i - 1] if i else None, tokens[i * bs:(i + 1) * bs])
            if tier is None:
                break
            hits.append((tier, hashes[i]))
        return hits

    def get_block_ids(self, request: Request, group: int = 0) -> list[int]:
        blocks = self.req_to_blocks.get(request.request_id)
        return [b.block_id for b in blocks[group]] if blocks else []

    def get_group_block_ids(self, request: Request) -> GroupBlockIds:
        return tuple(self.get_block_ids(request, g) for g in range(self.num_groups))

    def num_held_blocks(self, request: Request) -> int:
        blocks = self.req_to_blocks.get(request.request_id, ())
        return sum(1 for table in blocks for b in table if b is not self.null_block)

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: GroupBlockIds = (),
                       num_new_computed_tokens: int = 0, num_lookahead_tokens: int = 0,
                       tier_hits: Sequence[TierHit] = (), num_swapped_in_tokens: int = 0) -> GroupBlockIds | None:
        """Make ``request``'s tables cover the tokens this step computes.

        One table after the call (tier hits, swapped-in and new computed blocks: admission only)::

            | held, or new_computed_blocks | tier hits / swapped in | new tokens | lookahead |
            |<------- by reference ------->|<------------- fresh blocks, free queue -------->|

        The runner copies tier hits and swapped-in blocks in; lookahead (static batching) is capped
        at ``max_model_len``. Sliding groups first free blocks no token still to compute sees.
        Returns the new block ids per group, or None (no block taken) when the pool is short.
        ValueError for negative counts or computed blocks that do not match or come late.
        """
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks and self._sliding:
            self._free_out_of_window_blocks(blocks, request.num_computed_tokens)
        if (blocks and not new_computed_blocks and not num_lookahead_tokens and num_new_tokens >= 0
                and request.num_computed_tokens + num_new_tokens <= len(blocks[0]) * self.block_size):
            return tuple([] for _ in blocks)  # a decode inside its last block
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"num_new_tokens ({num_new_tokens}) and num_lookahead_tokens "
                             f"({num_lookahead_tokens}) must be >= 0")
        if new_computed_blocks and len(new_computed_blocks) != self.num_groups:
            raise ValueError(f"new_computed_blocks must hold one list per KV-cache group ({self.num_groups}), "
                             f"got {len(new_computed_blocks)}")
        num_computed_blocks = len(new_computed_blocks[0]) if new_computed_blocks else 0
        if num_new_computed_tokens != num_computed_blocks * self.block_size or \
                any(len(ids) != num_computed_blocks for ids in new_computed_blocks):
            raise ValueError(f"num_new_computed_tokens ({num_new_computed_tokens}) must equal the length of each "
                             f"group's new_computed_blocks * block_size ({num_computed_blocks * self.block_size})")
        if (num_computed_blocks or tier_hits or num_swapped_in_tokens) and blocks:
            raise ValueError(f"request {req_id!r} already holds blocks; computed blocks come only at admission")
        num_tier_tokens = len(tier_hits) * self.block_size
        num_known = (request.num_computed_tokens + num_new_computed_tokens + num_tier_tokens + num_swapped_in_tokens
                     + num_new_tokens)
        num_tokens = max(min(num_known + num_lookahead_tokens, self.max_model_len), num_known)
        num_held = (len(blocks[0]) if blocks else 0) + num_computed_blocks
        num_new_blocks = cdiv(num_tokens, self.block_size) - num_held
        pool = self.block_pool
        computed = [[pool.blocks[i] for i in ids] for ids in new_computed_blocks]
        # a hit on a free cached block takes it out of the free queue too
        num_evictable = sum(1 for group in computed for b in group if b.ref_cnt == 0 and b is not self.null_block)
        if num_new_blocks * self.num_groups > pool.num_free_blocks - num_evictable:
            return None

        if blocks is None:
            blocks = self.req_to_blocks[req_id] = tuple([] for _ in range(self.num_groups))
            self._num_handled_blocks[req_id] = num_computed_blocks
            if self.can_use_prefix_cache(request) and not num_swapped_in_tokens:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens + num_tier_tokens
        for table, hit in zip(blocks, computed):
            pool.touch(b for b in hit if b is not self.null_block)
            table.extend(hit)
        new_ids = []
        for table in blocks:
            new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
            table.extend(new_blocks)
            new_ids.append([b.block_id for b in new_blocks])
        for (tier, key), block_id in zip(tier_hits, new_ids[0]):
            self.offload.load(tier, key, block_id)
        return tuple(new_ids)

    def cache_blocks(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Publish the full computed blocks (a block whose hash another holds stays private)."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if not blocks:
            return
        n = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        num_full = min(n, request.num_tokens) // self.block_size
        start = self._num_handled_blocks[req_id]
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        tokens, bs = request.all_token_ids, self.block_size
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else None
            for g, table in enumerate(blocks):
                if table[i] is not self.null_block:
                    self.block_pool.cache_full_block(table[i], _group_key(hashes[i], g), parent,
                                                     tokens[i * bs:(i + 1) * bs])
        self._num_handled_blocks[req_id] = num_full

    def free_tail_blocks(self, request: Request, num_tokens: int) -> int:
        """Return the blocks past the first ``cdiv(num_tokens, block_size)`` of each table (after a
        verify step with ``num_tokens`` = the computed tokens: blocks only rejected drafts used,
        never published) to the free queue's head, so it is as it was before they were taken.
        Returns how many each table dropped."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return 0
        num_keep = max(cdiv(num_tokens, self.block_size), self._num_handled_blocks[request.request_id])
        num_drop = len(blocks[0]) - num_keep
        if num_drop <= 0:
            return 0
        for table in blocks:
            dropped = table[num_keep:]
            del table[num_keep:]
            # the oldest freed last: it sits at the head, the first block taken again
            self.block_pool.free_blocks(b for b in reversed(dropped) if b is not self.null_block)
        return num_drop

    def free(self, request: Request) -> None:
        """Release ``request``'s blocks, tail first: the one path for finish, abort and preemption."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_handled_blocks.pop(request.request_id, None)
        for table in blocks or ():
            self.block_pool.free_blocks(b for b in reversed(table) if b is not self.null_block)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _free_out_of_window_blocks(self, blocks: tuple[list[KVCacheBlock], ...], num_computed_tokens: int) -> None:
        for g, window in self._sliding:
            table = blocks[g]
            num_skipped = max(0, num_computed_tokens - window + 1) // self.block_size
            freed = []
            for i in range(min(num_skipped, len(table)) - 1, -1, -1):
                if table[i] is self.null_block:
                    break
                freed.append(table[i])
                table[i] = self.null_block
            if freed:
                # oldest first, evicted first: a later hit needs the newest ones
                self.block_pool.free_blocks(reversed(freed))
                self.num_window_freed_blocks += len(freed)

    def _find_hit(self, request: Request, hashes: list[bytes], group: int, num_blocks: int) -> list[KVCacheBlock]:
        window = self.kv_cache_groups[group].sliding_window
        tokens, bs, pool = request.all_token_ids, self.block_size, self.block_pool

        def lookup(i: int) -> KVCacheBlock | None:
            return pool.get_cached_block(_group_key(hashes[i], group), hashes[i - 1] if i else None,
                                         tokens[i * bs:(i + 1) * bs])

        if window is None:
            hit = []
            for i in range(num_blocks):
                block = lookup(i)
                if block is None:
                    break
                hit.append(block)
            return hit
        # sliding window: scan back for cdiv(W - 1, bs) consecutive hits
        num_needed = cdiv(window - 1, bs)
        hit: list[KVCacheBlock] = [self.null_block] * num_blocks
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            block = lookup(i)
            if block is None:
                run = 0
                continue
            hit[i] = block
            run += 1
            if run >= num_needed:
                return hit[:i + run]
        return hit[:run]  # the run reaches block 0: a hit even if shorter than the window

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        hashes = request.block_hashes
        bs, tokens = self.block_size, request.all_token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            extra = request.block_hash_extra_keys if i == 0 else None
            hashes.append(hash_block_tokens(hashes[i - 1] if i else None, tokens[i * bs:(i + 1) * bs], extra))
        return hashes

    def check_integrity(self) -> None:
        """AssertionError unless each block's ref_cnt is the number of tables holding it."""
        self.block_pool.check_integrity()
        if self.offload is not None:
            self.offload.check_integrity()
        holders: Counter[int] = Counter()
        for req_id, tables in self.req_to_blocks.items():
            assert len(tables) == self.num_groups, f"request {req_id!r} has {len(tables)} tables"
            assert len({len(t) for t in tables}) == 1, f"request {req_id!r}: group tables differ in length"
            for table in tables:
                ids = [b.block_id for b in table if b is not self.null_block]
                assert len(set(ids)) == len(ids), f"request {req_id!r} holds a block twice: {ids}"
                holders.update(ids)
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {holders.get(block.block_id, 0)} holders"


def _group_key(block_hash: bytes, group: int) -> bytes:
    """Prefix-cache key in ``group`` (vLLM's ``BlockHashWithGroupId``); group 0: the plain hash."""
    return block_hash if group == 0 else block_hash + group.to_bytes(4, "little")
