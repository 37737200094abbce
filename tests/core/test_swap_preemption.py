"""Swap preemption, core side: the victim's computed blocks go to the swap space and come
back into fresh blocks on resumption; a full swap space falls back to recompute.

The FakeRunner copies slot contents pool → swap slot → pool as the transfer ops say and
checks every position each request reads, so a wrong swap-in is caught where it happens.
"""

from __future__ import annotations

import random

from core_helpers import FakeRunner, make_config, make_request, reference_output, run_to_completion

from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.swap_space import SwapSpace


def _two_requests(swap: SwapSpace, **cfg):
    cfg.setdefault("enable_prefix_caching", False)
    s = Scheduler(make_config(max_model_len=32, **cfg), num_kv_blocks=8, record_trace=True, swap_space=swap)
    r = FakeRunner(s)
    a = make_request("a", list(range(1, 17)), max_tokens=4)  # 4 blocks each: the pool is full
    b = make_request("b", list(range(30, 46)), max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    r.step()
    return s, r, a, b


def test_swapped_request_resumes_where_it_stopped():
    s, r, a, b = _two_requests(SwapSpace(8, "swap"))
    so, _ = r.step()  # a's 17th token needs a 5th block: b (latest) is swapped out
    assert so.preempted_req_ids == {"b"}
    assert [slot for _, slot in so.kv_transfers.swap_out] == [0, 1, 2, 3]
    assert b.status == RequestStatus.PREEMPTED and b.preemption_modes == ["swap"]
    assert s.swap_space.num_free_blocks == 4
    run_to_completion(r)
    assert not any(t.get("b", 0) > 1 for t in s.step_trace[2:]), "b recomputed instead of swapping in"
    assert b.output_token_ids == reference_output(list(range(30, 46)), 4, 32)
    assert a.output_token_ids == reference_output(list(range(1, 17)), 4, 32)
    assert s.swap_space.num_free_blocks == 8 and s.kv_cache_manager.num_used_blocks == 0
    s.check_integrity()


def test_full_swap_space_falls_back_to_recompute():
    s, r, a, b = _two_requests(SwapSpace(2, "swap"))
    so, _ = r.step()
    assert so.preempted_req_ids == {"b"} and not so.kv_transfers.swap_out
    assert b.preemption_modes == ["recompute"] and s.swap_space.num_fallbacks == 1
    run_to_completion(r)
    assert any(t.get("b", 0) == 17 for t in s.step_trace), "b recomputes prompt + first output"
    assert b.output_token_ids == reference_output(list(range(30, 46)), 4, 32)


def test_abort_while_swapped_out_frees_the_slots():
    s, r, a, b = _two_requests(SwapSpace(8, "swap"))
    r.step()
    assert s.swap_space.num_free_blocks == 4
    s.abort_request("b")
    assert s.swap_space.num_free_blocks == 8
    run_to_completion(r)
    s.check_integrity()


def test_auto_mode_weighs_recompute_against_copy():
    space = SwapSpace(64, "auto", bytes_per_block=1000, copy_bytes_per_s=1e6)
    assert space.choose_mode(100, 7) == "recompute"  # nothing measured yet
    space.observe_prefill(seconds=1.0, num_tokens=1000)  # 1 ms per token
    assert space.choose_mode(100, 7) == "swap"  # 100 ms of prefill vs 14 ms of copies
    space.observe_prefill(seconds=0.0001, num_tokens=1000)
    space.prefill_s_per_token = 1e-6
    assert space.choose_mode(100, 7) == "recompute"  # 0.1 ms of prefill vs 14 ms of copies
    assert space.choose_mode(100, 65) == "recompute"  # does not fit


def test_random_workload_with_swap_matches_reference():
    rng = random.Random(3)
    s = Scheduler(make_config(max_model_len=48, max_num_batched_tokens=24), num_kv_blocks=14,
                  swap_space=SwapSpace(10, "swap"))
    r = FakeRunner(s)
    reqs = []
    for i in range(10):
        prompt = [rng.randrange(3, 30) for _ in range(rng.randint(3, 20))]
        reqs.append(make_request(f"r{i}", prompt, max_tokens=rng.randint(4, 20)))
        s.add_request(reqs[-1])
    run_to_completion(r)  # FakeRunner checks integrity and every read after each step
    assert s.num_preemptions > 0 and any("swap" in q.preemption_modes for q in reqs)
    for q in reqs:
        assert q.output_token_ids == reference_output(q.prompt_token_ids, q.max_tokens, 48)
    assert s.swap_space.num_free_blocks == 10 and s.kv_cache_manager.num_used_blocks == 0
