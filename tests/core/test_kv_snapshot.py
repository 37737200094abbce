"""The KV-cache snapshot behind the live map: block states, request rows, the event log."""

from __future__ import annotations

from core_helpers import FakeRunner, make_config, make_request, run_to_completion

from pagedllm.core.scheduler import Scheduler


def _expected_states(scheduler: Scheduler) -> str:
    """The state string recomputed from ref counts and hashes, block by block."""
    out = []
    pool = scheduler.kv_cache_manager.block_pool
    for b in pool.blocks:
        out.append("4" if b is pool.null_block else "3" if b.ref_cnt > 1 else "2" if b.ref_cnt == 1
                   else "1" if b.block_hash else "0")
    return "".join(out)


def _check(snap, scheduler: Scheduler) -> None:
    assert snap.block_states == _expected_states(scheduler)
    counts = (snap.num_free_blocks, snap.num_cached_blocks, snap.num_used_blocks, snap.num_shared_blocks,
              snap.num_null_blocks)
    assert sum(counts) == snap.num_blocks == scheduler.kv_cache_manager.block_pool.num_blocks
    held: dict[int, int] = {}
    for row in snap.requests:
        for b in row.block_ids:
            held[b] = held.get(b, 0) + 1
    for b, n in held.items():  # a block in two tables is shared, in one it is in use
        assert snap.block_states[b] == ("3" if n > 1 else "2")
    assert snap.num_used_blocks + snap.num_shared_blocks == len(held)


def test_shared_prefix_shows_shared_blocks_then_nothing_in_use():
    sched = Scheduler(make_config(num_kv_blocks=12), 12)
    runner = FakeRunner(sched)
    prefix = list(range(10, 18))  # two full blocks of 4
    sched.add_request(make_request("a", prefix + [30, 31], max_tokens=6))
    runner.step()  # "a" computes its prompt; its two full blocks are published
    sched.add_request(make_request("b", prefix + [40], max_tokens=6))
    runner.step()  # "b" is admitted on a's two blocks
    snap = sched.kv_cache_snapshot(num_steps=2)
    _check(snap, sched)
    assert snap.num_shared_blocks == 2 and snap.block_states.count("3") == 2
    rows = {r.request_id: r for r in snap.requests}
    assert rows["a"].block_ids[:2] == rows["b"].block_ids[:2]
    assert (rows["b"].status, rows["b"].num_cached_tokens, rows["b"].num_prompt_tokens) == ("running", 8, 9)
    hits = [e for e in snap.events if e.kind == "prefix_hit"]
    assert [(e.request_id, e.num_blocks, e.num_tokens) for e in hits] == [("b", 2, 8)]

    run_to_completion(runner)
    snap = sched.kv_cache_snapshot()
    _check(snap, sched)
    assert snap.num_used_blocks == snap.num_shared_blocks == 0 and snap.requests == []
    assert snap.num_cached_blocks > 0  # full blocks stay in the prefix cache, evictable
    assert snap.prefix_cache_hits == 8


def test_preemption_and_eviction_events():
    """8 blocks of 4 tokens: two requests growing to 20 tokens each cannot both stay."""
    sched = Scheduler(make_config(num_kv_blocks=8), 8)
    runner = FakeRunner(sched)
    sched.add_request(make_request("x", list(range(3, 11)), max_tokens=12))
    sched.add_request(make_request("y", list(range(50, 58)), max_tokens=12))
    seen_preempted_row = False
    while sched.has_unfinished_requests():
        runner.step()
        snap = sched.kv_cache_snapshot()
        _check(snap, sched)
        seen_preempted_row |= any(r.status == "preempted" and r.num_preemptions == 1 and not r.block_ids
                                  for r in snap.requests)
    kinds = [(e.kind, e.request_id) for e in sched.kv_events.events]
    assert ("preempted", "y") in kinds and ("resumed", "y") in kinds and seen_preempted_row
    assert kinds.index(("preempted", "y")) < kinds.index(("resumed", "y"))
    assert snap.num_preemptions == sched.num_preemptions >= 1
    evicted = [e for e in sched.kv_events.events if e.kind == "evicted"]
    assert sum(e.num_blocks for e in evicted) == snap.num_evicted_blocks


def test_event_log_keeps_the_last_n():
    sched = Scheduler(make_config(num_kv_blocks=12), 12, num_kv_events=3)
    for i in range(5):
        sched.kv_events.record("prefix_hit", f"r{i}", 1, 4)
    assert [e.request_id for e in sched.kv_cache_snapshot().events] == ["r2", "r3", "r4"]


def test_snapshot_is_plain_data():
    import json

    sched = Scheduler(make_config(num_kv_blocks=12), 12)
    sched.add_request(make_request("w", [5, 6, 7], max_tokens=2))
    body = sched.kv_cache_snapshot().to_dict()
    assert json.loads(json.dumps(body))["requests"][0]["status"] == "waiting"


def test_hybrid_pool_shows_the_null_block_and_one_table_per_group():
    from pagedllm.core.kv_cache_groups import KVCacheGroupSpec

    groups = [KVCacheGroupSpec((0,), None), KVCacheGroupSpec((1,), 4)]  # full + sliding window of 4 tokens
    sched = Scheduler(make_config(num_kv_blocks=16, max_num_batched_tokens=8), 16, kv_cache_groups=groups)
    runner = FakeRunner(sched)
    sched.add_request(make_request("h", list(range(3, 23)), max_tokens=4))  # 20 tokens: 5 blocks per group
    for _ in range(3):
        runner.step()  # chunks of 8 tokens: the sliding group frees blocks left behind its window
    snap = sched.kv_cache_snapshot()
    _check(snap, sched)
    assert snap.block_states[0] == "4" and snap.num_null_blocks == 1
    assert [g["sliding_window"] for g in snap.kv_cache_groups] == [None, 4]
    (row,) = snap.requests
    full, sliding = row.block_tables
    assert 0 in sliding and 0 not in full and 0 not in row.block_ids  # freed window entries point at null
    assert sorted(row.block_ids) == sorted(b for b in full + sliding if b != 0)
