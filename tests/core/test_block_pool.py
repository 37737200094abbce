"""BlockPool: hashing, free-queue (LRU) order, reference counts, eviction, integrity."""

import hashlib

import pytest

from pagedllm.core.block_pool import ROOT_BLOCK_HASH, BlockPool, FreeBlockQueue, KVCacheBlock, hash_block_tokens


# ---- block hash ------------------------------------------------------------------------
def test_hash_is_sha256_of_parent_and_int64_ids():
    expected = hashlib.sha256(ROOT_BLOCK_HASH + (1).to_bytes(8, "little") + (2).to_bytes(8, "little")).digest()
    assert hash_block_tokens(None, [1, 2]) == expected
    assert len(expected) == 32


def test_hash_full_width_token_ids_c03():
    # 65, 321 and 577 share their low byte: a truncating hash would collide.
    hashes = {hash_block_tokens(None, [t] * 16) for t in (65, 321, 577, 65 + 2**32)}
    assert len(hashes) == 4


def test_hash_is_chained_to_the_parent():
    h1, h2 = hash_block_tokens(None, [1, 2, 3, 4]), hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(h1, [9, 9, 9, 9]) != hash_block_tokens(h2, [9, 9, 9, 9])
    assert hash_block_tokens(h1, [9, 9, 9, 9]) == hash_block_tokens(h1, [9, 9, 9, 9])  # deterministic
    assert hash_block_tokens(None, [9, 9, 9, 9]) != hash_block_tokens(h1, [9, 9, 9, 9])


def test_hash_extra_keys_change_it():
    base = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2], ("salt-a",)) != base
    assert hash_block_tokens(None, [1, 2], ("salt-a",)) != hash_block_tokens(None, [1, 2], ("salt-b",))


# ---- construction ----------------------------------------------------------------------
@pytest.mark.parametrize("bs", [0, 3, 12, 512, -4, 2.0, True])
def test_bad_block_size_rejected(bs):
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(8, bs, True)


@pytest.mark.parametrize("bs", [1, 2, 16, 256])
def test_power_of_two_block_sizes_accepted(bs):
    assert BlockPool(4, bs, True).block_size == bs


def test_bad_num_blocks_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 4, True)


# ---- free queue --------------------------------------------------------------------------
def test_free_queue_remove_from_middle_and_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4] and q.num_free_blocks == 4
    q.appendleft(blocks[2])
    assert q.block_ids() == [2, 0, 1, 3, 4]
    assert q.popleft() is blocks[2]
    q.append(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4, 2]
    with pytest.raises(ValueError, match="already"):
        q.append(blocks[2])
    for _ in range(5):
        q.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()


# ---- pool --------------------------------------------------------------------------------
def _publish(pool, block, tokens, parent=None):
    h = hash_block_tokens(parent, tokens)
    assert pool.cache_full_block(block, h, parent, tokens)
    return h


def test_allocation_takes_from_head_with_ref_one():
    pool = BlockPool(8, 4, True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_block_queue.block_ids() == [3, 4, 5, 6, 7]
    assert pool.num_used_blocks == 3 and pool.usage == 3 / 8
    with pytest.raises(ValueError, match="cannot allocate 6"):
        pool.get_new_blocks(6)
    pool.check_integrity()


def test_free_order_cached_to_tail_uncached_to_head_and_lru_eviction():
    pool = BlockPool(8, 4, True)
    b0, b1, b2 = pool.get_new_blocks(3)
    h0 = _publish(pool, b0, [1, 2, 3, 4])
    h1 = _publish(pool, b1, [5, 6, 7, 8], parent=h0)
    pool.free_blocks([b2, b1, b0])  # reverse order: the request's tail first
    # b2 carries no hash: reused first. b1 (tail) is evicted before b0 (head).
    assert pool.free_block_queue.block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert pool.num_cached_free_blocks == 2 and pool.num_used_blocks == 0
    pool.check_integrity()
    got = pool.get_new_blocks(7)
    assert [b.block_id for b in got] == [2, 3, 4, 5, 6, 7, 1]
    assert h1 not in pool.cached_block_hash_to_block and b1.block_hash is None  # eviction drops the hash
    assert pool.cached_block_hash_to_block[h0] is b0 and b0.ref_cnt == 0
    assert pool.get_cached_block(h0, None, [1, 2, 3, 4]) is b0
    pool.check_integrity()


def test_touch_takes_cached_block_out_of_the_middle():
    pool = BlockPool(6, 4, True)
    blocks = pool.get_new_blocks(3)
    h = _publish(pool, blocks[1], [1, 1, 1, 1])
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_queue.block_ids() == [0, 2, 3, 4, 5, 1]
    hit = pool.get_cached_block(h, None, [1, 1, 1, 1])
    pool.touch([hit])
    pool.touch([hit])
    assert hit.ref_cnt == 2 and pool.free_block_queue.block_ids() == [0, 2, 3, 4, 5]
    assert pool.num_cached_free_blocks == 0 and pool.num_used_blocks == 1
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and 1 not in pool.free_block_queue.block_ids()
    pool.free_blocks([hit])
    assert pool.free_block_queue.block_ids() == [0, 2, 3, 4, 5, 1]
    pool.check_integrity()


def test_hit_verified_against_stored_tokens_and_parent():
    pool = BlockPool(4, 4, True)
    (b,) = pool.get_new_blocks(1)
    h = _publish(pool, b, [1, 2, 3, 4])
    assert pool.get_cached_block(h, None, [1, 2, 3, 4]) is b
    assert pool.get_cached_block(h, None, [1, 2, 3, 5]) is None  # same hash, other tokens: a miss
    assert pool.get_cached_block(h, b"\x01" * 32, [1, 2, 3, 4]) is None  # other parent: a miss


def test_a_hash_maps_to_one_block_duplicates_stay_unpublished():
    pool = BlockPool(4, 4, True)
    a, b = pool.get_new_blocks(2)
    h = _publish(pool, a, [7, 7, 7, 7])
    assert not pool.cache_full_block(b, h, None, (7, 7, 7, 7))
    assert b.block_hash is None and pool.cached_block_hash_to_block == {h: a}
    pool.free_blocks([b, a])
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 0]
    pool.check_integrity()


def test_caching_off_stores_nothing():
    pool = BlockPool(4, 4, False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(a, hash_block_tokens(None, [1] * 4), None, [1] * 4)
    assert pool.cached_block_hash_to_block == {} and a.block_hash is None


def test_double_free_raises():
    pool = BlockPool(4, 4, True)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([a])


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4, 4, True)
    (a,) = pool.get_new_blocks(1)
    _publish(pool, a, [1, 2, 3, 4])
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a])
    assert pool.num_cached_free_blocks == 1
    assert pool.reset_prefix_cache()
    assert pool.cached_block_hash_to_block == {} and pool.num_cached_free_blocks == 0 and a.block_hash is None
    pool.check_integrity()


def test_check_integrity_catches_corruption():
    pool = BlockPool(4, 4, True)
    (a,) = pool.get_new_blocks(1)
    a.ref_cnt = 0  # referenced nowhere, yet not in the free queue
    with pytest.raises(AssertionError, match="neither free nor referenced"):
        pool.check_integrity()
    a.ref_cnt = 1
    pool.cached_block_hash_to_block[b"x" * 32] = a  # map entry with no matching block hash
    with pytest.raises(AssertionError):
        pool.check_integrity()
