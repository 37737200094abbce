"""Offload tiers of the prefix cache, core side: which blocks are saved, hit, loaded, dropped.

Tiny numbers (block_size 4, a pool of 8 blocks). The FakeRunner copies slot contents
between the pool and its tier dicts exactly as the transfer ops say, and checks every
position a request reads through its block table, so a wrong load is caught.
"""

from __future__ import annotations

from core_helpers import FakeRunner, make_config, make_request, reference_output, run_to_completion

from pagedllm.core.block_pool import hash_block_tokens
from pagedllm.core.kv_offload import TIER_DISK, TIER_HOST, KVOffloadSpec, TierEntry
from pagedllm.core.scheduler import Scheduler

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # 3 full blocks + 1 token


def _scheduler(num_blocks: int = 8, **spec) -> tuple[Scheduler, FakeRunner]:
    sched = Scheduler(make_config(), num_blocks, kv_offload=KVOffloadSpec(**spec))
    return sched, FakeRunner(sched)


def _run(runner: FakeRunner, rid: str, prompt: list[int], max_tokens: int = 3):
    req = make_request(rid, prompt, max_tokens)
    runner.scheduler.add_request(req)
    run_to_completion(runner)
    assert req.output_token_ids == reference_output(prompt, max_tokens, 64)
    return req


def _churn(runner: FakeRunner, n: int = 3) -> None:
    """Unrelated prompts that need the whole pool, so every cached block is evicted."""
    for i in range(n):
        _run(runner, f"churn{i}", [100 + 20 * i + j for j in range(24)], max_tokens=2)


def _assert_tiers_match(sched: Scheduler, runner: FakeRunner) -> None:
    """The index and the runner's data hold the same keys in every tier."""
    for name, tier in sched.kv_cache_manager.offload.tiers.items():
        assert set(tier.entries) == set(runner.tiers.get(name, {})), name


def test_returning_prompt_hits_the_host_tier_after_churn():
    sched, runner = _scheduler(num_host_blocks=32)
    _run(runner, "a", PROMPT)
    _churn(runner)
    assert sched.kv_cache_manager.block_pool.get_cached_block(hash_block_tokens(None, PROMPT[:4]), None,
                                                              PROMPT[:4]) is None  # evicted from the pool
    again = _run(runner, "b", PROMPT + [40, 41])
    assert again.num_cached_tokens == 12
    assert again.cached_tokens_by_tier == {"pool": 0, "host": 12, "disk": 0}
    assert sched.kv_cache_manager.offload.num_loaded[TIER_HOST] == 3
    _assert_tiers_match(sched, runner)
    sched.check_integrity()
    assert sched.kv_cache_manager.num_used_blocks == 0


def test_pool_hit_then_tier_hit_continue_one_prefix():
    sched, runner = _scheduler(num_host_blocks=32)
    _run(runner, "a", PROMPT)
    _churn(runner)
    _run(runner, "b", PROMPT[:8] + [1])  # brings blocks 0-1 back into the pool from the tier
    again = _run(runner, "c", PROMPT)
    assert again.cached_tokens_by_tier == {"pool": 8, "host": 4, "disk": 0}


def test_host_tier_stays_within_its_bound_lru():
    sched, runner = _scheduler(num_host_blocks=2)
    _run(runner, "a", PROMPT)
    _churn(runner)
    tier = sched.kv_cache_manager.offload.tiers[TIER_HOST]
    assert len(tier) == 2
    _assert_tiers_match(sched, runner)
    again = _run(runner, "b", PROMPT)  # a's blocks were pushed out by the churn's
    assert again.num_cached_tokens == 0
    sched.check_integrity()


def test_a_tier_entry_with_other_tokens_is_never_used():
    sched, runner = _scheduler(num_host_blocks=32)
    _run(runner, "a", PROMPT)
    _churn(runner)
    tier = sched.kv_cache_manager.offload.tiers[TIER_HOST]
    key = hash_block_tokens(None, PROMPT[:4])
    tier.entries[key] = TierEntry(None, (1, 2, 3, 4))  # a collision: same hash, other tokens
    again = _run(runner, "b", PROMPT)
    assert again.num_cached_tokens == 0


def test_disk_entries_found_at_start_are_hits():
    key = hash_block_tokens(None, PROMPT[:4])
    sched, runner = _scheduler(num_disk_blocks=8, disk_entries=((key, None, tuple(PROMPT[:4])),))
    runner.tiers[TIER_DISK] = {key: [(0, t) for t in PROMPT[:4]]}  # the "file" a previous engine wrote
    again = _run(runner, "b", PROMPT)
    assert again.cached_tokens_by_tier == {"pool": 0, "host": 0, "disk": 4}


def test_write_through_to_both_tiers_and_host_first():
    sched, runner = _scheduler(num_host_blocks=32, num_disk_blocks=32)
    _run(runner, "a", PROMPT)
    _churn(runner)
    _assert_tiers_match(sched, runner)
    off = sched.kv_cache_manager.offload
    assert off.num_saved[TIER_HOST] == off.num_saved[TIER_DISK] > 0
    again = _run(runner, "b", PROMPT)
    assert again.cached_tokens_by_tier["host"] == 12


def test_disk_entries_over_the_bound_drop_the_oldest():
    entries = tuple((hash_block_tokens(None, [i] * 4), None, (i,) * 4) for i in range(5))
    sched, runner = _scheduler(num_disk_blocks=3, disk_entries=entries)
    runner.tiers[TIER_DISK] = {k: [None] * 4 for k, _, _ in entries}
    assert list(sched.kv_cache_manager.offload.tiers[TIER_DISK].entries) == [k for k, _, _ in entries[2:]]
    runner.step()
    _assert_tiers_match(sched, runner)
