"""Hybrid KV cache: groups per attention type, out-of-window blocks freed, prefix hits
that never rely on a freed block, capacity figures. Tiny numbers, exact answers."""

import random

import pytest

from pagedllm.core.kv_cache_groups import KVCacheGroupSpec, layers_per_block, make_kv_cache_groups
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler

from core_helpers import FakeRunner, make_config, make_request, reference_output, run_to_completion

FULL_AND_W8 = [KVCacheGroupSpec((0,), None), KVCacheGroupSpec((1,), 8)]


def _gemma3_windows(num_layers, window):
    return [None if i % 6 == 5 else window for i in range(num_layers)]


def test_groups_gemma3_270m_and_4b_shapes():
    groups = make_kv_cache_groups(_gemma3_windows(18, 512))
    assert groups[0] == KVCacheGroupSpec((5, 11, 17), None)
    assert [g.layer_ids for g in groups[1:]] == [(0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert all(g.sliding_window == 512 for g in groups[1:]) and layers_per_block(groups) == 3
    groups = make_kv_cache_groups(_gemma3_windows(34, 1024))  # 5 full, 29 sliding: the last group has 4
    assert [len(g.layer_ids) for g in groups] == [5, 5, 5, 5, 5, 5, 4] and layers_per_block(groups) == 5
    assert sorted(i for g in groups for i in g.layer_ids) == list(range(34))


def test_groups_single_type_near_equal_and_disabled():
    assert make_kv_cache_groups([None] * 4) == [KVCacheGroupSpec((0, 1, 2, 3), None)]
    assert make_kv_cache_groups([8] * 3) == [KVCacheGroupSpec((0, 1, 2), 8)]  # Mistral: all windowed
    alternating = make_kv_cache_groups([8, None] * 5 + [8])  # 6 vs 5 layers: within 25 %, one group each
    assert alternating == [KVCacheGroupSpec((1, 3, 5, 7, 9), None), KVCacheGroupSpec((0, 2, 4, 6, 8, 10), 8)]
    assert len(make_kv_cache_groups([8, None] * 3 + [8])) == 3  # 4 vs 3: groups of 3
    assert make_kv_cache_groups([8, None, 8], hybrid=False) == [KVCacheGroupSpec((0, 1, 2), None)]
    with pytest.raises(ValueError, match="layer 1"):
        make_kv_cache_groups([None, 0])


def test_max_blocks_per_sequence():
    sliding = KVCacheGroupSpec((1,), 8)
    # 8 - 1 tokens of window + a 4-token chunk = 11 tokens -> 3 blocks, +1 for misalignment
    assert sliding.max_num_blocks(1000, 4, 4) == 4
    assert sliding.max_num_blocks(8, 4, 64) == 2  # never more than the whole sequence
    kv = KVCacheManager(16, 4, True, 64, FULL_AND_W8)
    assert kv.max_num_blocks_per_seq(64, 1) == 16 + 3 and kv.num_total_blocks == 15


def test_decode_frees_out_of_window_blocks_exact_counts():
    kv = KVCacheManager(16, 4, True, 64, FULL_AND_W8)  # block 0 is the null block
    r = make_request("a", list(range(1, 7)), max_tokens=20)
    assert kv.allocate_slots(r, 6) == ([1, 2], [3, 4])
    r.num_computed_tokens = 6
    kv.cache_blocks(r)
    tables, freed = {}, {}
    for tok in range(100, 111):  # decode: compute token c = 6..16
        r.append_output_token_ids([tok])
        c = r.num_computed_tokens
        kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        kv.cache_blocks(r)
        kv.check_integrity()
        tables[c] = kv.get_group_block_ids(r)
        freed[c] = kv.num_window_freed_blocks
    # token c attends to c - 7 .. c: block i is freed once c - 7 >= 4 * (i + 1)
    assert tables[8] == ([1, 2, 5], [3, 4, 6])
    assert tables[10] == ([1, 2, 5], [3, 4, 6]) and freed[10] == 0
    assert tables[11] == ([1, 2, 5], [0, 4, 6]) and freed[11] == 1
    assert tables[12] == ([1, 2, 5, 7], [0, 4, 6, 8])
    assert tables[15] == ([1, 2, 5, 7], [0, 0, 6, 8]) and freed[15] == 2
    assert tables[16] == ([1, 2, 5, 7, 9], [0, 0, 6, 8, 10])
    assert kv.num_held_blocks(r) == 5 + 3 and kv.num_used_blocks == 8
    # the freed blocks were published: they wait, evictable, at the tail of the free queue
    assert kv.block_pool.free_block_queue.block_ids()[-2:] == [3, 4] and kv.num_cached_free_blocks == 2
    kv.free(r)
    kv.check_integrity()
    assert kv.num_used_blocks == 0 and kv.num_free_or_evictable_blocks == 15


def test_chunked_prefill_frees_blocks_before_the_next_chunk():
    kv = KVCacheManager(16, 4, False, 64, FULL_AND_W8)
    r = make_request("a", list(range(1, 25)), max_tokens=1)  # 24 tokens in chunks of 8
    held = []
    for _ in range(3):
        kv.allocate_slots(r, 8)
        r.num_computed_tokens += 8
        kv.check_integrity()
        held.append(kv.get_block_ids(r, 1))
    # chunk 2 starts at 8 (its tokens attend to >= 1: nothing freed); chunk 3 at 16 (>= 9: blocks 0, 1 go)
    assert held == [[3, 4], [3, 4, 7, 8], [0, 0, 7, 8, 9, 10]]
    assert kv.get_block_ids(r, 0) == [1, 2, 5, 6, 4, 3]  # the freed blocks went straight to the full group


def _run_request(kv, r, chunk=64):
    """Prefill (with any prefix hit) then decode until the output is exhausted."""
    ids, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, ids, n) is not None
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r)
    return ids, n


def test_prefix_hit_uses_only_the_window_blocks():
    kv = KVCacheManager(32, 4, True, 64, FULL_AND_W8)
    a = make_request("a", list(range(1, 7)), max_tokens=20)
    _run_request(kv, a)
    for tok in range(100, 111):  # as in the decode test: 17 tokens computed, sliding blocks 0, 1 freed
        a.append_output_token_ids([tok])
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        kv.cache_blocks(a)
    assert kv.get_group_block_ids(a) == ([1, 2, 5, 7, 9], [0, 0, 6, 8, 10])
    b = make_request("b", a.all_token_ids[:16] + [999])
    ids, n = kv.get_computed_blocks(b)
    # 16 tokens hit: full attention all 4 blocks, the window (7 tokens before token 16) blocks 2, 3 only
    assert (ids, n) == (([1, 2, 5, 7], [0, 0, 6, 8]), 16)
    kv.allocate_slots(b, 1, ids, n)
    assert kv.get_group_block_ids(b) == ([1, 2, 5, 7, 11], [0, 0, 6, 8, 12])
    kv.check_integrity()


def test_prefix_hit_never_relies_on_a_freed_and_evicted_block():
    kv = KVCacheManager(11, 4, True, 64, FULL_AND_W8)  # 10 usable blocks
    a = make_request("a", list(range(1, 17)), max_tokens=8)  # 16 tokens, 4 blocks per group
    _run_request(kv, a)
    a.append_output_token_ids([50])
    kv.allocate_slots(a, 1)  # computing token 16: sliding blocks 0, 1 (tokens 0-7) leave the window
    a.num_computed_tokens += 1
    assert kv.get_group_block_ids(a) == ([1, 2, 3, 4, 9], [0, 0, 7, 8, 10])
    # a full-attention-only lookup would hit 3 blocks; the window of token 12 needs sliding blocks 1, 2
    b = make_request("b", list(range(1, 13)) + [77])
    assert kv.get_computed_blocks(b) == (([1, 2, 3], [0, 6, 7]), 12)  # block 6 freed but still cached
    filler = make_request("f", [200 + i for i in range(4)])  # takes the last two free blocks: evicts 5, 6
    kv.allocate_slots(filler, 4)
    assert kv.block_pool.num_free_blocks == 0
    # sliding blocks 0 and 1 are gone: no length has its window's blocks (nor a run from token 0)
    assert kv.get_computed_blocks(b) == (([], []), 0)
    c = make_request("c", list(range(1, 17)) + [88])  # the window of token 16: sliding blocks 2, 3, held by a
    assert kv.get_computed_blocks(c) == (([1, 2, 3, 4], [0, 0, 7, 8]), 16)
    kv.check_integrity()


def test_scheduler_hybrid_runs_more_sequences_in_the_same_pool():
    """Same pool, long decodes: the hybrid manager keeps only the window, so more run at once
    and none is preempted; outputs equal the reference (the fake runner also checks every
    read inside the window comes back right)."""
    prompts = [[3 + i, 4, 5, 6, 7] for i in range(4)]
    results = {}
    for name, groups in (("full", [KVCacheGroupSpec((0,), None), KVCacheGroupSpec((1,), None)]),
                         ("hybrid", FULL_AND_W8)):
        s = Scheduler(make_config(block_size=4, max_model_len=64, max_num_batched_tokens=16), num_kv_blocks=49,
                      kv_cache_groups=groups)
        runner = FakeRunner(s)
        reqs = [make_request(f"{name}{i}", p, max_tokens=31) for i, p in enumerate(prompts)]
        for r in reqs:
            s.add_request(r)
        run_to_completion(runner)
        for r in reqs:
            assert r.output_token_ids == reference_output(r.prompt_token_ids, 31, 64)
        results[name] = (s.num_preemptions, s.kv_cache_manager.num_window_freed_blocks)
    # 35 tokens computed = 9 blocks per group: full-only needs 18 per sequence (72 for four, 48 usable),
    # hybrid 9 + at most 3 (window 8 = 7 tokens before + 1, over at most 3 blocks of 4)
    assert results["full"][0] > 0
    assert results["hybrid"] == (0, 4 * 6)  # computing token 34 needs >= 27: sliding blocks 0-5 went


def test_add_request_accepts_what_fits_only_with_windows():
    cfg = make_config(block_size=4, max_model_len=64, max_num_batched_tokens=4)
    s = Scheduler(cfg, num_kv_blocks=22, kv_cache_groups=FULL_AND_W8)
    s.add_request(make_request("long", [3] * 8, max_tokens=56))  # 16 + 4 blocks of 21 usable
    full = Scheduler(cfg, num_kv_blocks=22, kv_cache_groups=[KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,))])
    with pytest.raises(ValueError, match="need 32 KV blocks"):
        full.add_request(make_request("long", [3] * 8, max_tokens=56))
    runner = FakeRunner(s)
    run_to_completion(runner)
    assert s.kv_cache_manager.num_used_blocks == 0


def test_siblings_share_only_while_the_window_is_held():
    s = Scheduler(make_config(block_size=4, max_model_len=64, enable_prefix_caching=False), num_kv_blocks=40,
                  kv_cache_groups=FULL_AND_W8)
    runner = FakeRunner(s)
    kids = [make_request(f"k{i}", list(range(3, 15)), max_tokens=6, parent_id="p") for i in range(2)]
    for k in kids:
        s.add_request(k)
    run_to_completion(runner)
    for k in kids:
        assert k.output_token_ids == reference_output(k.prompt_token_ids, 6, 64)
    assert s.kv_cache_manager.num_used_blocks == 0


def test_random_traffic_with_windows_keeps_invariants_and_outputs():
    rng = random.Random(7)
    groups = [KVCacheGroupSpec((0, 1), None), KVCacheGroupSpec((2, 3), 6), KVCacheGroupSpec((4, 5), 6)]
    s = Scheduler(make_config(block_size=2, max_model_len=40, max_num_batched_tokens=7, max_num_seqs=4),
                  num_kv_blocks=40, kv_cache_groups=groups)
    runner = FakeRunner(s)
    base = [5, 6, 7, 8, 9, 10, 11, 12]
    reqs = []
    for wave in range(12):
        for i in range(3):
            prompt = base[:rng.randint(0, 8)] + [rng.randint(3, 20) for _ in range(rng.randint(1, 6))]
            reqs.append(make_request(f"w{wave}-{i}", prompt, max_tokens=rng.randint(1, 20)))
            s.add_request(reqs[-1])
        for _ in range(rng.randint(2, 8)):
            runner.step()
    run_to_completion(runner)
    kv = s.kv_cache_manager
    assert kv.num_used_blocks == 0 and kv.num_window_freed_blocks > 0 and kv.prefix_cache_hits > 0
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.max_tokens, 40)
