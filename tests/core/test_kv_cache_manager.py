"""KVCacheManager: block tables, prefix hits, publication, release order, accounting."""

import pytest

import pagedllm.core.kv_cache_manager as kvm
from pagedllm.core.kv_cache_manager import KVCacheManager

from core_helpers import make_request


def _compute(kv, req, num_tokens):
    """What one scheduled step does to memory: allocate, then (after the forward) publish."""
    ids, n = kv.get_computed_blocks(req) if req.request_id not in kv.req_to_blocks else ((), 0)
    new = kv.allocate_slots(req, num_tokens - n if num_tokens else req.num_tokens - n, ids, n)
    assert new is not None
    req.num_computed_tokens += n + (num_tokens - n if num_tokens else req.num_tokens - n)
    kv.cache_blocks(req)
    return ids, n, new


def _prefill(kv, req):
    return _compute(kv, req, 0)


def _refs(kv, req):
    return [kv.block_pool.blocks[i].ref_cnt for i in kv.get_block_ids(req)]


def test_issue_prefix_sharing_numbers_block_size_16():
    kv = KVCacheManager(16, 16, True, 128)
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks + 8
    a = make_request("a", prompt)
    _prefill(kv, a)
    assert kv.get_block_ids(a) == [0, 1, 2] and _refs(kv, a) == [1, 1, 1]

    b = make_request("b", prompt)
    ids, n, new = _prefill(kv, b)
    assert (ids, n, new) == (([0, 1],), 32, ([3],))
    assert kv.get_block_ids(b) == [0, 1, 3] and _refs(kv, a) == [2, 2, 1]

    c = make_request("c", prompt[:-1] + [999])  # differs only in its last token
    ids, n, _ = _prefill(kv, c)
    assert (ids, n) == (([0, 1],), 32) and _refs(kv, a)[:2] == [3, 3]

    d = make_request("d", [999] + prompt[1:])  # differs in token 0
    ids, n, _ = _prefill(kv, d)
    assert (ids, n) == (([],), 0) and kv.get_block_ids(d) == [5, 6, 7]
    assert kv.prefix_cache_queries == 160 and kv.prefix_cache_hits == 64
    kv.check_integrity()
    for r in (a, b, c, d):
        kv.free(r)
    assert kv.num_used_blocks == 0 and kv.num_free_or_evictable_blocks == 16
    kv.check_integrity()


def test_never_the_whole_prompt():
    kv = KVCacheManager(8, 4, True, 64)
    prompt = list(range(1, 9))  # exactly 2 blocks
    _prefill(kv, make_request("a", prompt))
    ids, n = kv.get_computed_blocks(make_request("b", prompt))
    assert (ids, n) == (([0],), 4)  # the last block is recomputed: the sampler needs a logit


def test_no_hits_with_prompt_logprobs_or_caching_off():
    kv = KVCacheManager(8, 4, True, 64)
    prompt = list(range(1, 11))
    _prefill(kv, make_request("a", prompt))
    assert kv.get_computed_blocks(make_request("b", prompt, prompt_logprobs=1)) == (([],), 0)
    off = KVCacheManager(8, 4, False, 64)
    a = make_request("c", prompt)
    _prefill(off, a)
    assert a.block_hashes == [] and off.block_pool.cached_block_hash_to_block == {}
    assert off.get_computed_blocks(make_request("d", prompt)) == (([],), 0)
    assert off.prefix_cache_queries == 0


def test_partial_tail_never_published_and_output_blocks_are():
    kv = KVCacheManager(8, 4, True, 64)
    r = make_request("a", [1, 2, 3, 4, 5, 6])
    _prefill(kv, r)
    assert len(kv.block_pool.cached_block_hash_to_block) == 1  # block 1 holds 2 tokens: private
    r.append_output_token_ids([7])
    _compute(kv, r, 1)  # decode: 7 tokens computed
    r.append_output_token_ids([8])
    assert len(kv.block_pool.cached_block_hash_to_block) == 1
    _compute(kv, r, 1)  # token 8 computed: block 1 = [5, 6, 7, 8] is full
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    other = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(other) == ((kv.get_block_ids(r)[:2],), 8)
    kv.check_integrity()


def test_c03_collision_safe_even_with_a_constant_hash(monkeypatch):
    x = list(range(1000, 1016))
    for constant in (False, True):
        if constant:
            monkeypatch.setattr(kvm, "hash_block_tokens", lambda parent, tokens, extra=None: b"\x00" * 32)
        kv = KVCacheManager(16, 16, True, 128)
        _prefill(kv, make_request("pa", [65] * 16 + x))
        assert kv.get_computed_blocks(make_request("pb", [321] * 16 + x)) == (([],), 0)
        assert kv.get_computed_blocks(make_request("pc", [577] * 16 + x)) == (([],), 0)
        # The same prompt still hits: at least its first block (all blocks with a real hash).
        ids, n = kv.get_computed_blocks(make_request("pa2", [65] * 16 + x + [5]))
        assert (ids, n) == ((([0],), 16) if constant else (([0, 1],), 32))


def test_c04_only_a_contiguous_run_from_the_start():
    X, Y, Z = list(range(16)), list(range(100, 116)), list(range(200, 216))
    T = list(range(300, 308))
    kv = KVCacheManager(32, 16, True, 128)
    _prefill(kv, make_request("p1", X + Y + T))
    assert kv.get_computed_blocks(make_request("p2", Z + Y + T)) == (([],), 0)  # Y matches, but after a miss

    p4 = make_request("p4", X + T, max_tokens=8)
    _prefill(kv, p4)
    generated = [400 + i for i in range(8)]
    for tok in generated:  # decode 8 tokens; the last one's K/V is never computed
        p4.append_output_token_ids([tok])
        if tok != generated[-1]:
            _compute(kv, p4, 1)
    assert p4.num_computed_tokens == 31
    kv.free(p4)
    cached = kv.block_pool.cached_block_hash_to_block
    assert all(len(b.token_ids) == 16 for b in cached.values())
    assert sum(1 for b in cached.values() if b.token_ids[:8] == tuple(T)) == 0  # P4's 15-token tail is private
    ids, n = kv.get_computed_blocks(make_request("p5", X + T + [500 + i for i in range(8)]))
    assert n == 16 and ids[0] == [kv.block_pool.get_cached_block(kvm.hash_block_tokens(None, X), None, X).block_id]


def test_allocate_none_when_full_changes_nothing():
    kv = KVCacheManager(4, 4, True, 64)
    a = make_request("a", list(range(1, 13)))
    _prefill(kv, a)  # 3 blocks
    b = make_request("b", list(range(50, 59)))  # needs 3 blocks, 1 free
    assert kv.allocate_slots(b, 9) is None
    assert kv.num_free_or_evictable_blocks == 1 and "b" not in kv.req_to_blocks
    assert kv.prefix_cache_queries == 12  # a failed admission is not counted
    kv.check_integrity()


def test_evictable_hit_blocks_count_against_free_space():
    kv = KVCacheManager(4, 4, True, 64)
    a = make_request("a", list(range(1, 13)))
    _prefill(kv, a)
    kv.free(a)  # 12 tokens = 3 full blocks, all cached, queued tail first
    assert kv.num_cached_free_blocks == 3 and kv.block_pool.free_block_queue.block_ids() == [3, 2, 1, 0]
    b = make_request("b", list(range(1, 13)) + [77] * 5)  # 17 tokens: hits 3 blocks, needs 2 more
    ids, n = kv.get_computed_blocks(b)
    assert (ids, n) == (([0, 1, 2],), 12)
    # 4 free in the queue, but taking the 3 hit blocks leaves only 1: not enough for 2 more.
    assert kv.allocate_slots(b, 5, ids, n) is None
    assert kv.num_cached_free_blocks == 3
    kv.check_integrity()


def test_free_reverse_order_evicts_tail_first():
    kv = KVCacheManager(6, 4, True, 64)
    a = make_request("a", list(range(1, 14)))  # 13 tokens: 3 full blocks + 1
    _prefill(kv, a)
    assert kv.get_block_ids(a) == [0, 1, 2, 3]
    kv.free(a)
    kv.free(a)  # idempotent
    assert kv.block_pool.free_block_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    b = make_request("b", list(range(60, 80)))  # 5 blocks: evicts the tail (2) then 1, keeps 0
    assert kv.allocate_slots(b, 20) == ([3, 4, 5, 2, 1],)
    assert kv.get_computed_blocks(make_request("c", list(range(1, 14)))) == (([0],), 4)
    kv.check_integrity()


def test_lookahead_reserves_and_fast_path():
    kv = KVCacheManager(8, 4, False, 20)
    r = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(r, 5, num_lookahead_tokens=100) == ([0, 1, 2, 3, 4],)  # capped at max_model_len 20
    r.num_computed_tokens = 5
    r.append_output_token_ids([6])
    assert kv.allocate_slots(r, 1) == ([],)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_model_len"):
        KVCacheManager(4, 4, True, 0)
    kv = KVCacheManager(4, 4, True, 64)
    r = make_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        kv.allocate_slots(r, 3, ([0],), 3)
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate_slots(r, -1)


def test_check_integrity_catches_ref_count_mismatch():
    kv = KVCacheManager(4, 4, True, 64)
    r = make_request("a", [1, 2, 3])
    kv.allocate_slots(r, 3)
    kv.block_pool.blocks[0].ref_cnt = 2
    with pytest.raises(AssertionError, match="ref_cnt 2 != 1"):
        kv.check_integrity()


def test_cache_salt_separates_tenants():
    kv = KVCacheManager(8, 4, True, 64)
    a = make_request("a", list(range(1, 10)))
    a.cache_salt = "tenant-1"
    _prefill(kv, a)
    b = make_request("b", list(range(1, 10)))
    assert kv.get_computed_blocks(b) == (([],), 0)
    c = make_request("c", list(range(1, 10)))
    c.cache_salt = "tenant-1"
    assert kv.get_computed_blocks(c)[1] == 8
