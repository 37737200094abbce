"""KVCacheManager: per-request block tables on top of the block pool.

The scheduler's only door to memory. It owns the block table of every request that
holds blocks (``req_to_blocks``), looks up prefix-cache hits, allocates slots for the
tokens a step will compute, publishes blocks to the prefix cache once their K/V is
computed, and frees a request's blocks on the one release path (:meth:`free`).

When a full block is published (a documented choice): :meth:`cache_blocks`, called by
the scheduler in ``update_from_output`` after ``num_computed_tokens`` advanced, i.e.
once the model runner has written the block's K/V. Publishing at scheduling time (as
vLLM does) would let a request admitted later in the *same* step hit a block whose K/V
the forward pass has not written yet, which is only correct if every attention backend
writes all of a layer's K/V before any attention of that layer; publishing after the
step holds for any backend. Consequence: two identical never-seen prompts in one step
both compute their blocks; the second finds the hashes taken and leaves its own blocks
unpublished (private to it), so a hash never maps to two blocks.

Hybrid KV cache (sliding-window layers; see :mod:`pagedllm.core.kv_cache_groups`): with
several KV-cache groups a request holds one block table per group, all of the same
length (logical block i covers the same tokens in every group), drawn from one pool.
In a sliding-window group (window W), before each allocation the blocks lying wholly
before token ``num_computed_tokens - W + 1`` — outside the window of every token still to
be computed — go back to the pool and their table entries point at the pool's null
block (block 0, reserved). A freed block that was published stays in the prefix cache
(evictable), like any freed block. Prefix-cache keys carry the group (vLLM's
``BlockHashWithGroupId``), and a hit is the longest length L at which every group has
what the next token needs: full attention all blocks before L, a sliding group the
``cdiv(W - 1, block_size)`` blocks before L (vLLM's ``SlidingWindowManager``; earlier
ones may have been freed and evicted, they are null in the hit).

Prefix-cache statistics are counted in tokens, once per admission (the first
``allocate_slots`` of a request's residency), so a request that waits several steps at
the head of the queue is not counted several times: ``prefix_cache_queries`` += its
token count, ``prefix_cache_hits`` += the tokens it did not have to compute.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from pagedllm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.core.kv_cache_groups import KVCacheGroupSpec, cdiv, max_num_blocks_per_seq
from pagedllm.core.kv_offload import KVOffloadManager, KVOffloadSpec
from pagedllm.core.request import Request

# Block ids per KV-cache group: entry g is group g's list (its table, or its new blocks).
GroupBlockIds = tuple[list[int], ...]
# A prefix hit in an offload tier: (tier name, block hash).
TierHit = tuple[str, bytes]


class KVCacheManager:
    """Block tables, prefix-cache lookups, slot allocation and release.

    Args:
        num_blocks: physical blocks in the pool (with a sliding-window group, block 0 is
            reserved as the null block).
        block_size: tokens per block (power of two, 1..256).
        enable_prefix_caching: share full blocks between requests by content hash. When
            False no hash is ever computed or stored and no lookup hits.
        max_model_len: most tokens one sequence may hold (prompt + output).
        kv_cache_groups: the model's KV-cache groups (from
            :func:`~pagedllm.core.kv_cache_groups.make_kv_cache_groups`); default one
            full-attention group.
        kv_offload: sizes of the offload tiers below the pool
            (:mod:`pagedllm.core.kv_offload`); used only with prefix caching on and a
            single KV-cache group, else ignored.

    Raises:
        ValueError: naming the argument, for a non-positive ``max_model_len``, an empty
            ``kv_cache_groups`` or a bad ``num_blocks`` / ``block_size`` (see :class:`BlockPool`).
    """

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
        # (group index, window) of each sliding-window group
        self._sliding = [(g, spec.sliding_window) for g, spec in enumerate(groups) if spec.sliding_window]
        self.block_pool = BlockPool(num_blocks, block_size, enable_prefix_caching,
                                    reserve_null_block=bool(self._sliding))
        self.null_block = self.block_pool.null_block
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        # The block tables: per request, one list per group (null_block where freed).
        self.req_to_blocks: dict[str, tuple[list[KVCacheBlock], ...]] = {}
        # Leading blocks of each request that cache_blocks already dealt with.
        self._num_handled_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up (one count per admission)
        self.prefix_cache_hits = 0  # of those, tokens served from cached blocks
        self.num_window_freed_blocks = 0  # cumulative: blocks freed for leaving every window
        self.offload: KVOffloadManager | None = None
        if kv_offload is not None and kv_offload.is_enabled and enable_prefix_caching and self.num_groups == 1:
            self.offload = KVOffloadManager(kv_offload)
            self.block_pool.on_evict = self.offload.on_evict

    # ---- figures ---------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        """Blocks requests can hold (the null block, if reserved, excluded)."""
        return self.block_pool.num_blocks - (self.null_block is not None)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref_cnt > 0 (held by at least one block table)."""
        return self.block_pool.num_used_blocks

    @property
    def num_free_or_evictable_blocks(self) -> int:
        """Blocks an allocation may take: free ones plus cached-but-unreferenced ones."""
        return self.block_pool.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still carry a hash (prefix-cache hits possible, evictable)."""
        return self.block_pool.num_cached_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0), in [0, 1]; cached-free blocks are not used."""
        return self.num_used_blocks / self.num_total_blocks

    @property
    def num_evicted_blocks(self) -> int:
        """Cached blocks whose hash an allocation dropped, since start."""
        return self.block_pool.num_evicted_blocks

    def block_states(self) -> str:
        """Every block's state, one character each (:meth:`BlockPool.block_states`)."""
        return self.block_pool.block_states()

    @property
    def prefix_cache_hit_rate(self) -> float:
        """prefix_cache_hits / prefix_cache_queries (0.0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks one group's table needs to cover ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def max_num_blocks_per_seq(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """Most blocks a sequence of ``num_tokens`` tokens holds at once across all groups
        when at most ``max_chunk_tokens`` are computed per step (sliding groups hold only
        their window; see :func:`~pagedllm.core.kv_cache_groups.max_num_blocks_per_seq`)."""
        return max_num_blocks_per_seq(self.kv_cache_groups, num_tokens, self.block_size, max_chunk_tokens)

    # ---- lookups ---------------------------------------------------------------------
    def can_use_prefix_cache(self, request: Request) -> bool:
        """Whether ``request`` may start from cached or shared K/V. Not with caching off,
        and not when it asks for prompt logprobs (cached positions produce no logits)."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlockIds, int]:
        """The longest cached prefix of ``request``'s tokens (prompt + output so far, so a
        preempted request hits its own blocks) that every group can continue from.

        Full-attention group: a contiguous run of cached blocks from token 0. Sliding
        group with window W: the ``cdiv(W - 1, block_size)`` blocks before the hit length
        (a shorter run only when it starts at token 0); earlier entries are the null
        block. With several groups the length is lowered until every group agrees (vLLM's
        hybrid coordinator). Each hit is verified against the block's stored parent hash
        and token ids. At least one token is always left to compute (the sampler needs
        its logits). Changes nothing but ``request.block_hashes`` (filled lazily).

        Returns:
            (block ids per group, all of one length n; tokens they cover = n * block_size).
        """
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
        """Full prompt blocks ``request`` can share with ``donor`` (a sibling of the same
        ``n > 1`` group that has computed them), whether or not prefix caching is on.

        Returns (block ids per group, tokens they cover); nothing when the donor holds
        none yet, the prompts differ, ``request`` asks for prompt logprobs, or a sliding
        group of the donor already freed a block ``request`` would need. At least one
        token of ``request`` is left to compute.
        """
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
        """Blocks after the first ``num_pool_blocks`` (the pool's hit) that the offload
        tiers hold, verified like pool hits: a contiguous run, host tier before disk, at
        least one token left to compute. Changes nothing; [] without tiers."""
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
        """``request``'s block table in ``group`` (physical block ids, logical order, the
        null block's id where a sliding group freed a block); [] if it holds none."""
        blocks = self.req_to_blocks.get(request.request_id)
        return [b.block_id for b in blocks[group]] if blocks else []

    def get_group_block_ids(self, request: Request) -> GroupBlockIds:
        """``request``'s block tables, one per group (see :meth:`get_block_ids`)."""
        return tuple(self.get_block_ids(request, g) for g in range(self.num_groups))

    def num_held_blocks(self, request: Request) -> int:
        """Physical blocks ``request``'s tables reference (null entries excluded)."""
        blocks = self.req_to_blocks.get(request.request_id, ())
        return sum(1 for table in blocks for b in table if b is not self.null_block)

    # ---- allocation ------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: GroupBlockIds = (),
                       num_new_computed_tokens: int = 0, num_lookahead_tokens: int = 0,
                       tier_hits: Sequence[TierHit] = (), num_swapped_in_tokens: int = 0) -> GroupBlockIds | None:
        """Make ``request``'s block tables cover the tokens this step computes.

        First, in sliding-window groups, blocks wholly outside the window of token
        ``request.num_computed_tokens`` (so of every token still to compute) are freed
        and replaced by the null block — also when the call then returns None, as they
        are never needed again. After the call every table covers
        ``request.num_computed_tokens + num_new_computed_tokens + num_new_tokens +
        num_lookahead_tokens`` tokens (capped at ``max_model_len``).
        ``new_computed_blocks`` (from :meth:`get_computed_blocks` or
        :meth:`get_shared_prefix_blocks`, only at admission, before any other block) are
        appended by reference (ref_cnt + 1); the rest comes from the free queue, evicting
        the least recently used cached blocks.

        Args:
            request: the request; ``num_computed_tokens`` is its count before this step.
            num_new_tokens: tokens to compute this step (>= 0).
            new_computed_blocks: ids of already computed blocks to take at admission, one
                list per group (or () for none).
            num_new_computed_tokens: tokens they cover (= len of each list * block_size).
            num_lookahead_tokens: extra slots to reserve now (static batching's
                worst-case reservation).
            tier_hits: at admission, the offload-tier hits that follow
                ``new_computed_blocks`` (from :meth:`get_tier_hits`): the first
                ``len(tier_hits)`` new blocks receive them (the runner copies them in
                before the forward pass) and their tokens count as computed, like
                ``num_new_computed_tokens``.
            num_swapped_in_tokens: at the admission of a request that was swapped out,
                the tokens its swapped blocks hold: the first ``cdiv(n, block_size)`` new
                blocks receive them (the caller records the copies); no prefix lookup
                counts.

        Returns:
            The ids of the newly allocated blocks per group (maybe empty lists), or None
            when the pool cannot satisfy the request; then no block was taken and the
            caller decides whom to preempt.

        Raises:
            ValueError: negative counts, or ``num_new_computed_tokens`` inconsistent with
                ``new_computed_blocks``, or computed blocks for a request holding blocks.
        """
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks and self._sliding:
            self._free_out_of_window_blocks(blocks, request.num_computed_tokens)
        if (blocks and not new_computed_blocks and not num_lookahead_tokens and num_new_tokens >= 0
                and request.num_computed_tokens + num_new_tokens <= len(blocks[0]) * self.block_size):
            return tuple([] for _ in blocks)  # fast path: a decode inside its last block
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
        num_new_blocks = cdiv(num_tokens, self.block_size) - num_held  # per group
        pool = self.block_pool
        computed = [[pool.blocks[i] for i in ids] for ids in new_computed_blocks]
        # touching free cached blocks uses free blocks (the null block is never touched)
        num_evictable = sum(1 for group in computed for b in group if b.ref_cnt == 0 and b is not self.null_block)
        if num_new_blocks * self.num_groups > pool.num_free_blocks - num_evictable:
            return None

        if blocks is None:  # admission: first allocation of this residency
            blocks = self.req_to_blocks[req_id] = tuple([] for _ in range(self.num_groups))
            self._num_handled_blocks[req_id] = num_computed_blocks
            if self.can_use_prefix_cache(request) and not num_swapped_in_tokens:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens + num_tier_tokens
        for table, hit in zip(blocks, computed):  # every group's hits leave the free queue first
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
        """Publish ``request``'s full blocks whose K/V is computed (the first
        ``num_computed_tokens``, default ``request.num_computed_tokens``) to the prefix
        cache, in every group: prompt and generated tokens alike. The partial tail block
        is never published. A block whose hash another block already holds stays private."""
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

    def free(self, request: Request) -> None:
        """Release every block ``request`` holds: the one path for finish, abort and
        preemption. Blocks go back in reverse order, so the request's tail is evicted
        before its head. Idempotent: a request holding nothing is a no-op."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_handled_blocks.pop(request.request_id, None)
        for table in blocks or ():
            self.block_pool.free_blocks(b for b in reversed(table) if b is not self.null_block)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes (only while no block is in use); True on success."""
        return self.block_pool.reset_prefix_cache()

    # ---- internals -------------------------------------------------------------------
    def _free_out_of_window_blocks(self, blocks: tuple[list[KVCacheBlock], ...], num_computed_tokens: int) -> None:
        """In each sliding group, free the blocks before token ``num_computed_tokens - W + 1``
        (the first any token still to compute attends to), newest first, stopping at
        the first null entry (everything before it was freed earlier)."""
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
                # oldest first, so it is evicted first: a later hit needs the newest ones
                self.block_pool.free_blocks(reversed(freed))
                self.num_window_freed_blocks += len(freed)

    def _find_hit(self, request: Request, hashes: list[bytes], group: int, num_blocks: int) -> list[KVCacheBlock]:
        """Group ``group``'s cache hit among the first ``num_blocks`` blocks: a list of at
        most ``num_blocks`` entries (null where a sliding group needs no block)."""
        window = self.kv_cache_groups[group].sliding_window
        tokens, bs, pool = request.all_token_ids, self.block_size, self.block_pool

        def lookup(i: int) -> KVCacheBlock | None:
            return pool.get_cached_block(_group_key(hashes[i], group), hashes[i - 1] if i else None,
                                         tokens[i * bs:(i + 1) * bs])

        if window is None:  # contiguous run from block 0
            hit = []
            for i in range(num_blocks):
                block = lookup(i)
                if block is None:
                    break
                hit.append(block)
            return hit
        # Sliding window: scan back from the end for cdiv(W - 1, bs) consecutive hits.
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
        """``request.block_hashes`` extended to cover its first ``num_blocks`` full blocks."""
        hashes = request.block_hashes
        bs, tokens = self.block_size, request.all_token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            salt = getattr(request, "cache_salt", None)
            extra = (salt,) if (i == 0 and salt) else None
            hashes.append(hash_block_tokens(hashes[i - 1] if i else None, tokens[i * bs:(i + 1) * bs], extra))
        return hashes

    def check_integrity(self) -> None:
        """Raise AssertionError unless the pool is consistent, every request's group tables
        have one length, and every block's ref_cnt equals the number of block tables
        holding it (no table holds a block twice; the null block is never counted)."""
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
    """Prefix-cache key of a block in KV-cache group ``group`` (vLLM's
    ``BlockHashWithGroupId``): the block hash, followed by the group index for groups
    after the first, so group 0's keys are the plain block hashes."""
    return block_hash if group == 0 else block_hash + group.to_bytes(4, "little")
