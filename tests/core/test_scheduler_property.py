"""Random interleavings against the invariants, and a fixed-seed eviction stress (C05).

The fake runner (core_helpers.FakeRunner) reads every position of every scheduled
sequence back through its block table, so a wrong prefix hit, an evicted-while-mapped
block or a write into a shared block fails at the step it happens. Its sampled token
is a pure function of the sequence, so every request that ran to its length must have
exactly the output of a run alone (`reference_output`), whatever preemption, chunking,
prefix caching and aborts did in between.
"""

import os
import random

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedllm.core.block_pool import hash_block_tokens
from pagedllm.core.kv_cache_groups import KVCacheGroupSpec, max_num_blocks_per_seq
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler

from core_helpers import FakeRunner, make_config, make_request, reference_output


def check_prefix_index(s: Scheduler) -> None:
    """Every hash-index entry is the hash of its block's stored parent hash and tokens
    (followed by the KV-cache group index for groups after the first)."""
    pool = s.kv_cache_manager.block_pool
    for h, block in pool.cached_block_hash_to_block.items():
        assert h[:32] == hash_block_tokens(block.parent_hash, block.token_ids)
        assert len(h) == 32 or 0 < int.from_bytes(h[32:], "little") < s.kv_cache_manager.num_groups


def draw_kv_cache_groups(data) -> list[KVCacheGroupSpec] | None:
    """One full-attention group (None), full + sliding, or all sliding, with a small window."""
    kind = data.draw(st.sampled_from(["full", "full", "hybrid", "sliding"]), label="kv_cache_groups")
    if kind == "full":
        return None
    window = data.draw(st.integers(1, 9), label="sliding_window")
    if kind == "sliding":
        return [KVCacheGroupSpec((0,), window)]
    return [KVCacheGroupSpec((0,), None), KVCacheGroupSpec((1,), window)]


BASES = [[3, 4, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27]]


@st.composite
def prompts(draw, max_len):
    base = draw(st.sampled_from(BASES))[: draw(st.integers(0, 8))]
    tail = draw(st.lists(st.integers(3, 6), max_size=6))
    p = (base + tail)[:max_len]
    return p or [3]


# Deterministic in CI; PAGEDLLM_HYPOTHESIS_EXAMPLES=2000 explores further (and randomly).
_EXAMPLES = int(os.environ.get("PAGEDLLM_HYPOTHESIS_EXAMPLES", "120"))


@settings(max_examples=_EXAMPLES, deadline=None, derandomize="PAGEDLLM_HYPOTHESIS_EXAMPLES" not in os.environ,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_add_schedule_abort_keeps_invariants(data):
    bs = data.draw(st.sampled_from([1, 2, 4]), label="block_size")
    num_blocks = data.draw(st.integers(3, 10), label="num_blocks")
    mml = data.draw(st.integers(6, 24), label="max_model_len")
    chunked = data.draw(st.booleans(), label="chunked")
    budget = data.draw(st.integers(1 if chunked else mml, 40), label="budget")
    cfg = make_config(block_size=bs, max_model_len=mml, max_num_batched_tokens=budget,
                      enable_chunked_prefill=chunked, enable_prefix_caching=data.draw(st.booleans(), label="caching"),
                      max_num_seqs=data.draw(st.integers(1, 4), label="max_num_seqs"),
                      scheduling_policy=data.draw(st.sampled_from(["fcfs", "priority"]), label="policy"),
                      batching=data.draw(st.sampled_from(["continuous"] * 4 + ["static"]), label="batching"))
    groups = draw_kv_cache_groups(data)
    s = Scheduler(cfg, num_blocks, kv_cache_groups=groups)
    runner = FakeRunner(s)
    num_usable = s.kv_cache_manager.num_total_blocks  # the null block, if any, excluded
    added, aborted, failed_ids = [], set(), set()
    for op_index in range(data.draw(st.integers(1, 40), label="num_ops")):
        op = data.draw(st.sampled_from(["add", "add", "add", "step", "step", "abort"]))
        if op == "add":
            prompt = data.draw(prompts(mml + 2))
            max_tokens = data.draw(st.integers(1, 12))
            n = data.draw(st.sampled_from([1, 1, 1, 2, 3]))
            worst = min(len(prompt) + max_tokens, mml)
            chunk = worst if cfg.batching == "static" else cfg.token_budget
            fits = len(prompt) <= mml and max_num_blocks_per_seq(
                groups or [KVCacheGroupSpec((0,))], worst, bs, chunk) <= num_usable
            for c in range(n):
                req = make_request(f"r{op_index}-{c}", prompt, max_tokens=max_tokens,
                                   priority=data.draw(st.integers(0, 2)),
                                   parent_id=f"r{op_index}" if n > 1 else None)
                try:
                    s.add_request(req)
                    assert fits, "add_request accepted a request that can never fit"
                    added.append(req)
                except ValueError:
                    assert not fits, "add_request rejected a request that fits"
        elif op == "step":
            so = s.schedule()
            failed = {}
            if so.num_scheduled_tokens and data.draw(st.integers(0, 9)) == 0:
                rid = data.draw(st.sampled_from(sorted(so.num_scheduled_tokens)))
                failed[rid] = "injected"
                failed_ids.add(rid)
            s.update_from_output(so, runner.execute(so, failed))
        elif added:
            req = data.draw(st.sampled_from(added))
            if not req.is_finished:
                aborted.add(req.request_id)
            s.abort_request(req.request_id)
        s.check_integrity()
        check_prefix_index(s)
    steps = 0
    while s.has_unfinished_requests():
        runner.step()
        check_prefix_index(s)
        steps += 1
        assert steps < 2000, "no progress"
    kv = s.kv_cache_manager
    assert kv.num_used_blocks == 0 and kv.num_free_or_evictable_blocks == num_usable
    event(f"preempted: {s.num_preemptions > 0}")  # coverage, see --hypothesis-show-statistics
    event(f"prefix hits: {kv.prefix_cache_hits > 0}")
    event(f"evictions: {kv.block_pool.num_evicted_blocks > 0}")
    event(f"blocks freed out of window: {kv.num_window_freed_blocks > 0}")
    for req in added:
        assert req.is_finished
        if req.request_id in aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
        elif req.request_id in failed_ids:
            assert req.status == RequestStatus.FINISHED_ERROR
        else:
            assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
            assert req.output_token_ids == reference_output(req.prompt_token_ids, req.max_tokens, mml)


def test_c05_eviction_under_pressure_with_shared_prefixes():
    rng = random.Random(1234)
    x = [[40 + 4 * b + i for i in range(4)] for b in range(3)]  # three 4-token blocks
    prompts = [x[0][:3], x[0] + [7, 8], x[0] + x[1] + [9], x[0] + x[1] + x[2] + [5],
               x[0] + x[1] + [11, 12, 13], [60, 61, 62, 63, 64, 65]]  # share 0-3 leading blocks
    mml = 32
    s = Scheduler(make_config(block_size=4, max_model_len=mml, max_num_seqs=2, max_num_batched_tokens=16,
                              enable_prefix_caching=True), num_kv_blocks=12)
    runner = FakeRunner(s)
    reqs = []
    pool = s.kv_cache_manager.block_pool
    for wave in range(20):
        for i in range(10):
            req = make_request(f"w{wave}-{i}", rng.choice(prompts), max_tokens=rng.randint(1, 12))
            s.add_request(req)
            reqs.append(req)
        for _ in range(rng.randint(3, 12)):
            runner.step()
            check_prefix_index(s)
            assert all(b.ref_cnt >= 0 for b in pool.blocks)
            # a block in two tables is always a published full prefix block
            assert all(b.block_hash is not None for b in pool.blocks if b.ref_cnt > 1)
    while s.has_unfinished_requests():
        runner.step()
    for req in reqs:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, req.max_tokens, mml)
    kv = s.kv_cache_manager
    assert kv.num_free_or_evictable_blocks == kv.num_total_blocks == 12
    assert kv.prefix_cache_hits > 0 and pool.num_evicted_blocks > 0  # the scenario did exercise both
