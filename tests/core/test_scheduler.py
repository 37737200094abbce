"""Scheduler driven by hand-made ModelRunnerOutputs and a fake runner (no model)."""

import pytest

from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler

from core_helpers import EOS, FakeRunner, make_config, make_request, reference_output, run_to_completion


def _out(*pairs):
    """ModelRunnerOutput from (req_id, token) pairs."""
    return ModelRunnerOutput(req_ids=[p[0] for p in pairs], sampled_token_ids=[[p[1]] for p in pairs])


# ---- add_request -------------------------------------------------------------------------
def test_add_request_rejections_name_the_numbers():
    s = Scheduler(make_config(max_model_len=32), num_kv_blocks=4)
    with pytest.raises(ValueError, match="empty"):
        s.add_request(make_request("a", []))
    with pytest.raises(ValueError, match=r"33 tokens .* max_model_len \(32\)"):
        s.add_request(make_request("b", [1] * 33))
    with pytest.raises(ValueError, match=r"need 5 KV blocks .* only 4"):
        s.add_request(make_request("c", [1] * 10, max_tokens=10))
    s.add_request(make_request("d", [1] * 10, max_tokens=6))  # 16 tokens = 4 blocks: fits
    with pytest.raises(ValueError, match="already"):
        s.add_request(make_request("d", [1]))
    with pytest.raises(ValueError, match="max_model_len must be resolved"):
        Scheduler(make_config(max_model_len=None, max_num_batched_tokens=None), 4)
    assert s.get_num_unfinished_requests() == 1


# ---- chunked prefill, token budget -------------------------------------------------------
def test_chunk_sizes_per_step_and_decodes_first():
    s = Scheduler(make_config(max_num_batched_tokens=8), num_kv_blocks=12, record_trace=True)
    r = FakeRunner(s)
    s.add_request(make_request("a", list(range(1, 6)), max_tokens=6))  # 5 tokens
    s.add_request(make_request("b", list(range(10, 30)), max_tokens=2))  # 20 tokens
    run_to_completion(r)
    assert s.step_trace[:6] == [
        {"a": 5, "b": 3},  # b's first chunk takes what is left of the budget
        {"a": 1, "b": 7},  # a decodes first, b continues with 7 of 17
        {"a": 1, "b": 7},
        {"a": 1, "b": 3},  # b's last chunk: it samples
        {"a": 1, "b": 1},
        {"a": 1},  # b finished (max_tokens 2)
    ]
    assert s.kv_cache_manager.num_used_blocks == 0


def test_prompt_tokens_capped_while_requests_decode():
    s = Scheduler(make_config(max_num_batched_tokens=16, max_prefill_tokens_while_decoding=3), num_kv_blocks=20,
                  record_trace=True)
    r = FakeRunner(s)
    s.add_request(make_request("a", list(range(1, 5)), max_tokens=5))  # 4 tokens
    s.add_request(make_request("b", list(range(10, 17)), max_tokens=2))  # 7 tokens
    s.add_request(make_request("c", [5, 6], max_tokens=1))
    run_to_completion(r)
    assert s.step_trace == [
        {"a": 4, "b": 7, "c": 2},  # nothing decodes yet: the whole budget
        {"a": 1, "b": 1},  # c finished on its first token
        {"a": 1}, {"a": 1}, {"a": 1},
    ]
    s.add_request(make_request("d", list(range(1, 4)), max_tokens=6))
    s.add_request(make_request("e", list(range(30, 38)), max_tokens=1))  # 8 tokens
    s.add_request(make_request("f", [7, 8], max_tokens=1))
    run_to_completion(r)
    assert s.step_trace[5:] == [
        {"d": 3, "e": 8, "f": 2},
        {"d": 1},  # e and f finished
        {"d": 1}, {"d": 1}, {"d": 1}, {"d": 1},
    ]
    s.add_request(make_request("g", list(range(1, 3)), max_tokens=8))
    r.step()
    h = make_request("h", list(range(40, 48)), max_tokens=1)  # 8 tokens while g decodes
    s.add_request(h)
    s.add_request(make_request("i", [7, 8], max_tokens=1))
    run_to_completion(r)
    assert s.step_trace[11:16] == [
        {"g": 2},
        {"g": 1, "h": 3},  # g decodes: at most 3 prompt tokens ride along
        {"g": 1, "h": 3},
        {"g": 1, "h": 2, "i": 1},  # h's last chunk, then i's first token within the same cap
        {"g": 1, "i": 1},
    ]
    assert h.output_token_ids == reference_output(h.prompt_token_ids, 1, 64)  # chunking changes no token
    assert s.kv_cache_manager.num_used_blocks == 0


def test_chunked_prefill_off_admits_whole_or_waits():
    s = Scheduler(make_config(enable_chunked_prefill=False, max_model_len=16, max_num_batched_tokens=16),
                  num_kv_blocks=12, record_trace=True)
    r = FakeRunner(s)
    s.add_request(make_request("a", list(range(1, 11)), max_tokens=2))
    s.add_request(make_request("b", list(range(20, 30)), max_tokens=2))  # 10 > 6 left: waits whole
    s.add_request(make_request("c", [5, 6], max_tokens=2))  # would fit, but may not pass b (HOL)
    run_to_completion(r)
    # step 0: b (10) does not fit the 6 tokens left and is not chunked; c may not pass it
    assert s.step_trace == [{"a": 10}, {"a": 1, "b": 10, "c": 2}, {"b": 1, "c": 1}]


def test_new_then_cached_request_data():
    s = Scheduler(make_config(), num_kv_blocks=12)
    s.add_request(make_request("a", list(range(1, 8)), max_tokens=3))  # 7 tokens: blocks 0, 1
    so = s.schedule()
    (new,) = so.scheduled_new_reqs
    assert (new.req_id, new.token_ids, new.num_prompt_tokens, new.block_ids, new.num_computed_tokens) == \
        ("a", [1, 2, 3, 4, 5, 6, 7], 7, ([0, 1],), 0)
    s.update_from_output(so, _out(("a", 11)))
    so = s.schedule()  # position 7 still fits block 1
    assert so.scheduled_new_reqs == [] and so.num_scheduled_tokens == {"a": 1}
    (cached,) = so.scheduled_cached_reqs
    assert (cached.new_block_ids, cached.num_computed_tokens) == (([],), 7)
    s.update_from_output(so, _out(("a", 12)))
    so = s.schedule()  # position 8 opens block 2
    (cached,) = so.scheduled_cached_reqs
    assert (cached.new_block_ids, cached.num_computed_tokens) == (([2],), 8)
    (a,) = s.update_from_output(so, _out(("a", 13)))
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.output_token_ids == [11, 12, 13]
    assert s.schedule().finished_req_ids == {"a"}


def test_runner_contract_violations_raise():
    s = Scheduler(make_config(max_num_batched_tokens=4), num_kv_blocks=12)
    s.add_request(make_request("a", list(range(1, 7))))
    so = s.schedule()  # 4 of 6 tokens
    with pytest.raises(ValueError, match="mid-prefill"):
        s.update_from_output(so, _out(("a", 9)))
    s2 = Scheduler(make_config(), num_kv_blocks=12)
    s2.add_request(make_request("a", [1, 2]))
    with pytest.raises(ValueError, match="sampled nothing"):
        s2.update_from_output(s2.schedule(), ModelRunnerOutput())


# ---- stop conditions ---------------------------------------------------------------------
def _one_request(**kw):
    s = Scheduler(make_config(max_model_len=kw.pop("max_model_len", 64)), num_kv_blocks=16)
    req = make_request("a", [5, 6, 7], **kw)
    s.add_request(req)
    return s, req


def _feed(s, tokens):
    for t in tokens:
        so = s.schedule()
        s.update_from_output(so, _out(("a", t)))


def test_stop_on_eos_and_ignore_eos():
    s, req = _one_request(max_tokens=10, ignore_eos=False)
    _feed(s, [9, EOS])
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [9, EOS]
    assert req.stop_reason is None and not s.has_unfinished_requests()
    s, req = _one_request(max_tokens=3, ignore_eos=True)
    _feed(s, [EOS, EOS, EOS])
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and req.num_output_tokens == 3


def test_stop_token_ids_and_min_tokens():
    s, req = _one_request(max_tokens=10, ignore_eos=False, stop_token_ids=[42], min_tokens=3)
    _feed(s, [42, EOS, 42])  # the first two are below min_tokens: not stops
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 42
    assert req.output_token_ids == [42, EOS, 42]


def test_length_by_max_model_len():
    s, req = _one_request(max_tokens=100, max_model_len=6)  # 3 prompt tokens + 3
    _feed(s, [9, 9, 9])
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and req.num_tokens == 6
    assert s.kv_cache_manager.num_used_blocks == 0


# ---- preemption --------------------------------------------------------------------------
def test_preempts_latest_arrival_and_resumes_by_recompute():
    s = Scheduler(make_config(max_model_len=32, enable_prefix_caching=False), num_kv_blocks=8, record_trace=True)
    r = FakeRunner(s)
    s.add_request(make_request("a", list(range(1, 17)), max_tokens=4))  # 4 blocks each: pool full
    s.add_request(make_request("b", list(range(30, 46)), max_tokens=4))
    r.step()
    assert [x.request_id for x in s.running] == ["a", "b"]
    so, _ = r.step()  # both decode; a's position 16 needs a 5th block and the pool is full
    assert so.preempted_req_ids == {"b"} and so.finished_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    b = s.waiting[0]
    assert b.request_id == "b" and b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.output_token_ids != [] and b.num_computed_tokens == 0 and s.num_preemptions == 1
    # b's blocks carry no hash (caching off): back at the head of the free queue, in order
    assert s.kv_cache_manager.get_block_ids(s.running[0]) == [0, 1, 2, 3, 4]
    run_to_completion(r)
    resumed = [i for i, t in enumerate(s.step_trace) if t.get("b", 0) == 17]
    assert resumed, "b recomputes prompt (16) + its first output token"
    assert s.get_stats().num_preemptions == 1 and s.kv_cache_manager.num_used_blocks == 0


def test_priority_preempts_lowest_priority_even_if_earlier():
    s = Scheduler(make_config(max_model_len=32, enable_prefix_caching=False, scheduling_policy="priority"),
                  num_kv_blocks=8)
    r = FakeRunner(s)
    s.add_request(make_request("low", list(range(1, 17)), max_tokens=4, priority=5))
    s.add_request(make_request("high", list(range(30, 46)), max_tokens=4, priority=0))
    r.step()
    so, _ = r.step()
    assert so.preempted_req_ids == {"low"} and so.num_scheduled_tokens == {"high": 1}
    run_to_completion(r)


def test_priority_policy_orders_waiting():
    s = Scheduler(make_config(scheduling_policy="priority", max_num_seqs=1), num_kv_blocks=16, record_trace=True)
    r = FakeRunner(s)
    for rid, prio in (("a", 3), ("b", 1), ("c", 2), ("d", 1)):
        s.add_request(make_request(rid, [1, 2, 3], max_tokens=1, priority=prio))
    run_to_completion(r)
    assert [next(iter(t)) for t in s.step_trace] == ["b", "d", "c", "a"]


def test_preempted_request_hits_its_own_blocks():
    s = Scheduler(make_config(max_model_len=32, enable_prefix_caching=True), num_kv_blocks=8)
    r = FakeRunner(s)
    s.add_request(make_request("a", list(range(1, 17)), max_tokens=4))
    b = make_request("b", list(range(30, 46)), max_tokens=4)
    s.add_request(b)
    r.step()  # both prompts computed and published (4 blocks each)
    r.step()  # b preempted: its blocks go to the free queue tail-first, still cached
    # a's 5th block evicted b's last block (the head of the queue); b's first 3 remain
    assert s.kv_cache_manager.num_cached_free_blocks == 3
    hits_before = s.kv_cache_manager.prefix_cache_hits
    run_to_completion(r)
    assert s.kv_cache_manager.prefix_cache_hits - hits_before == 12  # b resumed on 3 cached blocks
    assert b.num_cached_tokens == 0  # set on first admission only
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED and b.num_preemptions == 1


# ---- abort, failure, finish_requests -----------------------------------------------------
def test_abort_in_any_state_frees_everything():
    s = Scheduler(make_config(max_num_seqs=1), num_kv_blocks=12)
    r = FakeRunner(s)
    s.add_request(make_request("a", list(range(1, 10)), max_tokens=8))
    s.add_request(make_request("b", list(range(1, 10)), max_tokens=8))
    r.step()
    assert s.kv_cache_manager.num_used_blocks == 3
    aborted = s.abort_request(["a", "b", "unknown"])
    assert [x.status for x in aborted] == [RequestStatus.FINISHED_ABORTED] * 2
    assert s.abort_request("a") == []  # twice: a no-op
    assert not s.has_unfinished_requests() and s.kv_cache_manager.num_used_blocks == 0
    s.check_integrity()
    assert s.schedule().finished_req_ids == {"a"}  # b never reached the runner


def test_failed_request_ends_with_error_others_continue():
    s = Scheduler(make_config(), num_kv_blocks=12)
    r = FakeRunner(s)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    s.add_request(make_request("b", [4, 5, 6], max_tokens=3))
    so, changed = r.step(failed={"a": "sampler exploded"})
    assert {x.request_id: x.status for x in changed} == {
        "a": RequestStatus.FINISHED_ERROR, "b": RequestStatus.RUNNING}
    assert s.kv_cache_manager.get_block_ids(changed[0]) == []
    run_to_completion(r)
    assert changed[1].num_output_tokens == 3 and s.kv_cache_manager.num_used_blocks == 0


def test_reset_runner_state_resends_everything_in_full():
    s = Scheduler(make_config(), num_kv_blocks=12)
    s.add_request(make_request("a", list(range(1, 6)), max_tokens=5))
    s.update_from_output(s.schedule(), _out(("a", 9)))
    s.reset_runner_state()  # the runner lost its state
    so = s.schedule()
    (new,) = so.scheduled_new_reqs
    assert (new.token_ids, new.block_ids, new.num_computed_tokens) == ([1, 2, 3, 4, 5, 9], ([0, 1],), 5)
    assert so.scheduled_cached_reqs == []


def test_finish_requests_for_stop_strings():
    s, req = _one_request(max_tokens=10)
    _feed(s, [9])
    (ended,) = s.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert ended is req and req.status == RequestStatus.FINISHED_STOPPED
    assert s.kv_cache_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match="FINISHED_"):
        s.finish_requests("a", RequestStatus.RUNNING)


# ---- n > 1 groups ------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [False, True])
def test_siblings_share_prompt_blocks_by_reference(caching):
    s = Scheduler(make_config(block_size=16, max_model_len=128, enable_prefix_caching=caching), num_kv_blocks=16)
    r = FakeRunner(s)
    prompt = list(range(100, 140))  # 40 tokens
    kids = [make_request(f"g-{i}", prompt, max_tokens=3, parent_id="g", arrival_time=1.0) for i in range(3)]
    for k in kids:
        s.add_request(k)
    so, _ = r.step()
    assert so.num_scheduled_tokens == {"g-0": 40}  # siblings held while g-0 computes the prompt
    so, _ = r.step()
    assert so.num_scheduled_tokens == {"g-0": 1, "g-1": 8, "g-2": 8}
    tables = [s.kv_cache_manager.get_block_ids(k) for k in kids]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2] == [0, 1]
    assert len({t[2] for t in tables}) == 3  # private tails
    pool = s.kv_cache_manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in (0, 1)] == [3, 3]
    assert [k.num_cached_tokens for k in kids] == [0, 32, 32]
    run_to_completion(r)
    assert [k.output_token_ids for k in kids][0] == kids[1].output_token_ids  # same fake 'greedy' model
    assert s.kv_cache_manager.num_used_blocks == 0


def test_c09_group_with_early_finisher_survives_preemption():
    s = Scheduler(make_config(max_model_len=32, max_num_batched_tokens=32), num_kv_blocks=9)
    r = FakeRunner(s)
    prompt = list(range(3, 15))  # 12 tokens = 3 blocks, shared by the 3 children
    kids = [make_request(f"g-{i}", prompt, max_tokens=m, parent_id="g", arrival_time=1.0)
            for i, m in enumerate((2, 14, 14))]
    for k in kids:
        s.add_request(k)
    resumed = []
    while s.has_unfinished_requests():
        so, _ = r.step()
        resumed += [n for n in so.scheduled_new_reqs if n.num_prompt_tokens != len(n.token_ids)]
    assert s.num_preemptions > 0 and resumed, "the pool was meant to force a preemption"
    assert all(n.num_prompt_tokens == 12 for n in resumed)  # output is never relabelled as prompt
    for k in kids:
        assert k.prompt_token_ids == prompt and k.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert k.output_token_ids == reference_output(prompt, k.max_tokens, 32)
    assert s.kv_cache_manager.num_used_blocks == 0


# ---- static batching ---------------------------------------------------------------------
def test_static_batching_reserves_worst_case_and_waits_for_the_batch():
    s = Scheduler(make_config(batching="static", max_num_seqs=2, enable_prefix_caching=False),
                  num_kv_blocks=12, record_trace=True)
    r = FakeRunner(s)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=2))  # 5 tokens: 2 blocks
    s.add_request(make_request("b", [4, 5, 6], max_tokens=9))  # 12 tokens: 3 blocks
    s.add_request(make_request("c", [7, 8, 9], max_tokens=1))
    r.step()
    kv = s.kv_cache_manager
    assert [len(kv.get_block_ids(x)) for x in s.running] == [2, 3]
    run_to_completion(r)
    first_c = next(i for i, t in enumerate(s.step_trace) if "c" in t)
    last_b = max(i for i, t in enumerate(s.step_trace) if "b" in t)
    assert first_c == last_b + 1  # c waited for the whole batch, although a seat was free
    assert s.num_preemptions == 0 and kv.num_used_blocks == 0


# ---- head-of-line (C12) ------------------------------------------------------------------
def test_hol_strict_order_blocked_head_is_not_passed():
    s = Scheduler(make_config(max_model_len=32), num_kv_blocks=8, record_trace=True)
    r = FakeRunner(s)
    s.add_request(make_request("a", list(range(1, 21)), max_tokens=4))  # 6 blocks
    s.add_request(make_request("big", list(range(40, 60)), max_tokens=4))  # 5+ blocks: waits
    s.add_request(make_request("small", [7], max_tokens=1))  # would fit, but may not pass
    r.step()
    assert [x.request_id for x in s.waiting] == ["big", "small"]
    run_to_completion(r)
    order = [rid for t in s.step_trace for rid in t]
    assert order.index("big") < order.index("small")


def test_c12_max_num_seqs_and_decodes_keep_flowing():
    s = Scheduler(make_config(block_size=16, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64),
                  num_kv_blocks=16, record_trace=True)
    r = FakeRunner(s)
    s.add_request(make_request("L", list(range(1000, 1180)), max_tokens=40))
    for i in range(6):
        s.add_request(make_request(f"S{i}", [500 + i] * 10, max_tokens=5))
    s.add_request(make_request("L2", list(range(2000, 2150)), max_tokens=10))
    steps = 0
    while s.has_unfinished_requests():
        decoding = {x.request_id for x in s.running if x.num_tokens - x.num_computed_tokens == 1}
        so, _ = r.step()
        steps += 1
        assert len(s.running) <= 2
        assert decoding <= set(so.num_scheduled_tokens), "a running decode missed a step"
        assert steps < 400
    assert s.kv_cache_manager.num_used_blocks == 0


# ---- prefix caching at scheduler level (C01, C06) ---------------------------------------
def test_c01_identical_prompts_in_one_step_and_caching_on_off_equal():
    prompt = list(range(10, 50))  # 40 tokens
    outputs = {}
    for caching in (False, True):
        s = Scheduler(make_config(block_size=16, max_model_len=128, max_num_batched_tokens=128,
                                  enable_prefix_caching=caching), 32)
        r = FakeRunner(s)
        reqs = [make_request(f"p{i}", prompt, max_tokens=8) for i in range(2)]
        for q in reqs:
            s.add_request(q)
        so, _ = r.step()
        assert so.num_scheduled_tokens == {"p0": 40, "p1": 40}  # both compute: nothing published yet
        run_to_completion(r)
        pool = s.kv_cache_manager.block_pool
        assert s.kv_cache_manager.num_used_blocks == 0
        assert len(set(pool.cached_block_hash_to_block)) == len(pool.cached_block_hash_to_block)
        # a later identical prompt hits the published blocks
        p3 = make_request("p3", prompt, max_tokens=8)
        s.add_request(p3)
        run_to_completion(r)
        assert p3.num_cached_tokens == (32 if caching else 0)
        outputs[caching] = [q.output_token_ids for q in reqs + [p3]]
    assert outputs[True] == outputs[False]


def test_c06_no_leak_after_finish_abort_error_and_groups():
    s = Scheduler(make_config(block_size=16, max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=16), 64)
    r = FakeRunner(s)
    for i in range(30):
        s.add_request(make_request(f"n{i}", [i % 7 + 3] * (10 + i), max_tokens=5 + i % 4))
    for i in range(5):
        with pytest.raises(ValueError):
            s.add_request(make_request(f"long{i}", [1] * 1100))
    for i in range(5):
        s.add_request(make_request(f"ab{i}", [9] * 20, max_tokens=30))
    for g in range(5):
        for c in range(3):
            s.add_request(make_request(f"g{g}-{c}", [g + 40] * 37, max_tokens=6, parent_id=f"g{g}"))
    for i in range(3):
        s.add_request(make_request(f"err{i}", [11] * 12, max_tokens=6))
    steps = 0
    while s.has_unfinished_requests():
        so = s.schedule()
        failed = {rid: "boom" for rid in so.num_scheduled_tokens if rid.startswith("err")}
        s.update_from_output(so, r.execute(so, failed))
        s.check_integrity()
        steps += 1
        if steps == 4:
            s.abort_request([f"ab{i}" for i in range(5)])
        assert steps < 500
    kv = s.kv_cache_manager
    assert kv.num_used_blocks == 0 and kv.usage == 0.0 and kv.num_free_or_evictable_blocks == 64
    big = make_request("big", [77] * 1000, max_tokens=8)  # 1008 tokens = 63 blocks
    s.add_request(big)
    run_to_completion(r)
    assert big.status == RequestStatus.FINISHED_LENGTH_CAPPED and big.num_output_tokens == 8


def test_get_stats_figures():
    s = Scheduler(make_config(), num_kv_blocks=12)
    r = FakeRunner(s)
    s.add_request(make_request("a", list(range(1, 10)), max_tokens=2))
    s.add_request(make_request("b", list(range(1, 10)), max_tokens=2))
    r.step()
    st = s.get_stats()
    assert (st.num_running, st.num_waiting, st.num_used_blocks, st.num_free_blocks, st.num_total_blocks) == \
        (2, 0, 6, 6, 12)
    assert st.kv_cache_usage == 0.5 and st.prefix_cache_queries == 18 and st.prefix_cache_hits == 0
    run_to_completion(r)
    st = s.get_stats()
    assert st.num_used_blocks == 0 and st.num_cached_blocks == 2 and st.num_free_blocks == 12


def test_serving_default_caps_prompt_tokens_on_cpu_only():
    from pagedllm.config import SERVING_CPU_PREFILL_TOKENS_WHILE_DECODING

    config = make_config()
    assert config.max_prefill_tokens_while_decoding is None  # offline: no cap
    assert (config.with_serving_defaults("cpu").max_prefill_tokens_while_decoding
            == SERVING_CPU_PREFILL_TOKENS_WHILE_DECODING)
    assert config.with_serving_defaults("cuda").max_prefill_tokens_while_decoding is None
    assert make_config(max_prefill_tokens_while_decoding=500).with_serving_defaults("cpu").max_prefill_tokens_while_decoding == 500
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        make_config(max_prefill_tokens_while_decoding=0)


# ---- long prompts: long_prefill_token_threshold, max_num_partial_prefills ------------------
def _long_prompt_run(**kw):
    """`a` decodes while two long prompts (L1: 20 tokens, L2: 12) and a short one (s: 3) arrive."""
    s = Scheduler(make_config(max_num_batched_tokens=16, long_prefill_token_threshold=4, **kw), num_kv_blocks=30,
                  record_trace=True)
    r = FakeRunner(s)
    reqs = [make_request("a", [1, 2], max_tokens=12)]
    s.add_request(reqs[0])
    r.step()
    reqs += [make_request("L1", list(range(3, 23)), max_tokens=2), make_request("L2", list(range(30, 42)), max_tokens=2),
             make_request("s", [5, 6, 7], max_tokens=3)]
    for req in reqs[1:]:
        s.add_request(req)
    run_to_completion(r)
    for req in reqs:  # nobody starved, and splitting changed no token
        assert req.output_token_ids == reference_output(req.prompt_token_ids, req.max_tokens, 64), req.request_id
    assert s.kv_cache_manager.num_used_blocks == 0
    return s.step_trace


def test_long_prompts_split_across_steps_while_decodes_continue_and_short_ones_pass():
    trace = _long_prompt_run(max_num_partial_prefills=2, max_long_partial_prefills=1)
    assert trace == [
        {"a": 2},
        {"a": 1, "L1": 4, "s": 3},  # L1 is long: 4 per step; so is L2, and the long slot is taken: s passes it
        {"a": 1, "s": 1, "L1": 4},
        {"a": 1, "s": 1, "L1": 4},
        {"a": 1, "L1": 4},
        {"a": 1, "L1": 4, "L2": 4},  # L1's last chunk frees the long slot
        {"a": 1, "L1": 1, "L2": 4},
        {"a": 1, "L2": 4},  # L2: 12 tokens in 4-token chunks
        {"a": 1, "L2": 1},
        {"a": 1}, {"a": 1}, {"a": 1},
    ]
    assert all("a" in step for step in trace[:12])  # a decodes every step until it finishes


def test_one_partial_prefill_keeps_strict_order():
    trace = _long_prompt_run(max_num_partial_prefills=1, max_long_partial_prefills=1)
    assert trace[:7] == [
        {"a": 2},
        {"a": 1, "L1": 4},  # L2 would be a second partial prefill: it waits, and s may not pass it
        {"a": 1, "L1": 4},
        {"a": 1, "L1": 4},
        {"a": 1, "L1": 4},
        {"a": 1, "L1": 4, "L2": 4, "s": 3},  # L1 completes: the slot is L2's, s completes in this step
        {"a": 1, "L1": 1, "s": 1, "L2": 4},
    ]
    assert all("a" in step for step in trace[:12])


def test_partial_prefill_knobs_are_validated_by_name():
    from pagedllm.entrypoints.args import add_engine_args, engine_config_from_args
    import argparse

    for kw, field in [(dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
                      (dict(long_prefill_token_threshold=65), "long_prefill_token_threshold"),  # > max_model_len
                      (dict(long_prefill_token_threshold=8, enable_chunked_prefill=False, max_num_batched_tokens=64),
                       "long_prefill_token_threshold"),
                      (dict(max_num_partial_prefills=0), "max_num_partial_prefills"),
                      (dict(max_num_partial_prefills=2, enable_chunked_prefill=False), "max_num_partial_prefills"),
                      (dict(max_long_partial_prefills=0), "max_long_partial_prefills"),
                      (dict(max_num_partial_prefills=2, max_long_partial_prefills=3), "max_long_partial_prefills")]:
        with pytest.raises(ValueError, match=field):
            make_config(**kw)
    # vLLM's resolution: unset with concurrent partial prefills = 4% of max_model_len
    assert make_config(max_model_len=1000, max_num_partial_prefills=2).long_prefill_threshold == 40
    assert make_config(max_model_len=1000).long_prefill_threshold == 0
    p = argparse.ArgumentParser()
    add_engine_args(p)
    config = engine_config_from_args(p.parse_args(["--long-prefill-token-threshold", "32", "--max-num-partial-prefills",
                                                   "3", "--max-long-partial-prefills", "2"]))
    assert (config.long_prefill_token_threshold, config.max_num_partial_prefills,
            config.max_long_partial_prefills) == (32, 3, 2)


def test_long_prompt_passed_by_short_ones_does_not_starve():
    s = Scheduler(make_config(max_num_batched_tokens=16, long_prefill_token_threshold=4, max_num_partial_prefills=2,
                              max_num_seqs=64), num_kv_blocks=200, record_trace=True)
    r = FakeRunner(s)
    s.add_request(make_request("L1", list(range(3, 15)), max_tokens=1))  # 12 tokens: 3 steps
    s.add_request(make_request("L2", list(range(30, 42)), max_tokens=1))
    for step in range(8):  # a new short prompt every step, each behind L2
        s.add_request(make_request(f"s{step}", [5, 6, step + 7], max_tokens=1))
        r.step()
    first = {rid: next(i for i, t in enumerate(s.step_trace) if rid in t) for rid in ("L1", "L2", "s0", "s3")}
    assert first == {"L1": 0, "L2": 2, "s0": 0, "s3": 3}  # L2 starts with L1's last chunk; s3 after it
    run_to_completion(r)
    assert s.kv_cache_manager.num_used_blocks == 0 and not s.has_unfinished_requests()
