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
unpublished (private to it), so a hash never maps to two blocks (case C01).

Prefix-cache statistics are counted in tokens, once per admission (the first
``allocate_slots`` of a request's residency), so a request that waits several steps at
the head of the queue is not counted several times: ``prefix_cache_queries`` += its
token count, ``prefix_cache_hits`` += the tokens it did not have to compute.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from pagedllm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


class KVCacheManager:
    """Block tables, prefix-cache lookups, slot allocation and release.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block (power of two, 1..256).
        enable_prefix_caching: share full blocks between requests by content hash. When
            False no hash is ever computed or stored and no lookup hits.
        max_model_len: most tokens one sequence may hold (prompt + output).

    Raises:
        ValueError: naming the argument, for a non-positive ``max_model_len`` or a bad
            ``num_blocks`` / ``block_size`` (see :class:`BlockPool`).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, max_model_len: int) -> None:
        if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        self.block_pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}  # the block tables
        # Leading blocks of each request that cache_blocks already dealt with.
        self._num_handled_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up (one count per admission)
        self.prefix_cache_hits = 0  # of those, tokens served from cached blocks

    # ---- figures ---------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

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
        return self.block_pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        """prefix_cache_hits / prefix_cache_queries (0.0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    # ---- lookups ---------------------------------------------------------------------
    def can_use_prefix_cache(self, request: Request) -> bool:
        """Whether ``request`` may start from cached or shared K/V. Not with caching off,
        and not when it asks for prompt logprobs (cached positions produce no logits)."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached full blocks matching the start of ``request``'s
        tokens (prompt + output so far, so a preempted request hits its own blocks).

        A block after the first miss never counts (only a contiguous run from token 0);
        each hit is verified against the block's stored parent hash and token ids. At
        least one token is always left to compute (the sampler needs its logits).
        Changes nothing but ``request.block_hashes`` (filled lazily).

        Returns:
            (block ids, number of tokens they cover = len(block ids) * block_size).
        """
        if not self.can_use_prefix_cache(request):
            return [], 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_num_blocks)
        tokens, bs = request.all_token_ids, self.block_size
        block_ids: list[int] = []
        parent = None
        for i in range(max_num_blocks):
            block = self.block_pool.get_cached_block(hashes[i], parent, tokens[i * bs:(i + 1) * bs])
            if block is None:
                break
            block_ids.append(block.block_id)
            parent = hashes[i]
        return block_ids, len(block_ids) * bs

    def get_shared_prefix_blocks(self, request: Request, donor: Request) -> tuple[list[int], int]:
        """Full prompt blocks ``request`` can share with ``donor`` (a sibling of the same
        ``n > 1`` group that has computed them), whether or not prefix caching is on.

        Returns (block ids, tokens they cover); ([], 0) when the donor holds none yet,
        the prompts differ, or ``request`` asks for prompt logprobs. At least one token
        of ``request`` is left to compute.
        """
        donor_blocks = self.req_to_blocks.get(donor.request_id)
        if not donor_blocks or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        num_tokens = min(donor.num_computed_tokens, request.num_prompt_tokens, request.num_tokens - 1)
        num_blocks = min(num_tokens // self.block_size, len(donor_blocks))
        n = num_blocks * self.block_size
        if request.prompt_token_ids[:n] != donor.prompt_token_ids[:n]:
            return [], 0
        return [b.block_id for b in donor_blocks[:num_blocks]], n

    def get_block_ids(self, request: Request) -> list[int]:
        """``request``'s block table (physical block ids, logical order); [] if it holds none."""
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, ())]

    # ---- allocation ------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = (),
                       num_new_computed_tokens: int = 0, num_lookahead_tokens: int = 0) -> list[int] | None:
        """Make ``request``'s block table cover the tokens this step computes.

        After the call the table covers ``request.num_computed_tokens +
        num_new_computed_tokens + num_new_tokens + num_lookahead_tokens`` tokens (capped
        at ``max_model_len``). ``new_computed_blocks`` (from :meth:`get_computed_blocks`
        or :meth:`get_shared_prefix_blocks`, only at admission, before any other block)
        are appended by reference (ref_cnt + 1); the rest comes from the free queue,
        evicting the least recently used cached blocks.

        Args:
            request: the request; ``num_computed_tokens`` is its count before this step.
            num_new_tokens: tokens to compute this step (>= 0).
            new_computed_blocks: ids of already computed blocks to take at admission.
            num_new_computed_tokens: tokens they cover (= len * block_size).
            num_lookahead_tokens: extra slots to reserve now (static batching's
                worst-case reservation).

        Returns:
            The ids of the newly allocated blocks (maybe []), or None when the pool
            cannot satisfy the request; then nothing changed and the caller decides whom
            to preempt.

        Raises:
            ValueError: negative counts, or ``num_new_computed_tokens`` inconsistent with
                ``new_computed_blocks``, or computed blocks for a request holding blocks.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if (blocks and not new_computed_blocks and not num_lookahead_tokens and num_new_tokens >= 0
                and request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size):
            return []  # fast path: a decode inside its last block
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"num_new_tokens ({num_new_tokens}) and num_lookahead_tokens "
                             f"({num_lookahead_tokens}) must be >= 0")
        if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
            raise ValueError(f"num_new_computed_tokens ({num_new_computed_tokens}) must equal "
                             f"len(new_computed_blocks) * block_size ({len(new_computed_blocks) * self.block_size})")
        req_id = request.request_id
        if new_computed_blocks and blocks:
            raise ValueError(f"request {req_id!r} already holds blocks; computed blocks come only at admission")
        num_known = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_tokens = max(min(num_known + num_lookahead_tokens, self.max_model_len), num_known)
        num_held = (len(blocks) if blocks else 0) + len(new_computed_blocks)
        num_new_blocks = cdiv(num_tokens, self.block_size) - num_held
        pool = self.block_pool
        computed = [pool.blocks[i] for i in new_computed_blocks]
        num_evictable = sum(1 for b in computed if b.ref_cnt == 0)  # touching them uses free blocks
        if num_new_blocks > pool.num_free_blocks - num_evictable:
            return None

        if blocks is None:  # admission: first allocation of this residency
            blocks = self.req_to_blocks[req_id] = []
            self._num_handled_blocks[req_id] = len(computed)
            if self.can_use_prefix_cache(request):
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
        pool.touch(computed)
        blocks.extend(computed)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        blocks.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Publish ``request``'s full blocks whose K/V is computed (the first
        ``num_computed_tokens``, default ``request.num_computed_tokens``) to the prefix
        cache: prompt and generated tokens alike. The partial tail block is never
        published. A block whose hash another block already holds stays private."""
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
            self.block_pool.cache_full_block(blocks[i], hashes[i], hashes[i - 1] if i else None,
                                             tokens[i * bs:(i + 1) * bs])
        self._num_handled_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block ``request`` holds: the one path for finish, abort and
        preemption. Blocks go back in reverse order, so the request's tail is evicted
        before its head. Idempotent: a request holding nothing is a no-op."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_handled_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes (only while no block is in use); True on success."""
        return self.block_pool.reset_prefix_cache()

    # ---- internals -------------------------------------------------------------------
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
        """Raise AssertionError unless the pool is consistent and every block's ref_cnt
        equals the number of block tables holding it (no table holds a block twice)."""
        self.block_pool.check_integrity()
        holders: Counter[int] = Counter()
        for req_id, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(set(ids)) == len(ids), f"request {req_id!r} holds a block twice: {ids}"
            holders.update(ids)
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {holders.get(block.block_id, 0)} holders"
