"""The scheduler with draft tokens, driven by a fake runner that verifies them: drafts are
scheduled under the token budget, their slots allocated and written through the block tables,
and after a step ``num_computed_tokens``, block tables, block counts, the free queue and the
prefix cache's hashes are what they would be without speculation."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from pagedllm.core.kv_cache_groups import cdiv
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from tests.core.core_helpers import FakeRunner, make_config, make_request, next_token, reference_output


@dataclass
class SpecFakeRunner(FakeRunner):
    """FakeRunner that also verifies drafts: each scheduled position's token (the drafts after
    the last one) is written into its slot, every read goes through the block table, and the
    'greedy model' (``next_token``) accepts the longest draft prefix it agrees with."""

    draft_fn: object = None  # (request, rng) -> draft; None: no drafts
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def execute(self, so: SchedulerOutput, failed=None) -> ModelRunnerOutput:
        bs = self.scheduler.block_size
        pool = self.scheduler.kv_cache_manager.block_pool
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        self.apply_transfers(so)
        for new in so.scheduled_new_reqs:
            from tests.core.core_helpers import _RunnerState

            self.states[new.req_id] = _RunnerState(list(new.token_ids), tuple(list(t) for t in new.block_ids),
                                                   new.num_computed_tokens)
        for cached in so.scheduled_cached_reqs:
            st = self.states[cached.req_id]
            for table, new_ids in zip(st.block_ids, cached.new_block_ids, strict=True):
                del table[len(table) - cached.num_dropped_blocks:]
                table.extend(new_ids)
            st.num_computed_tokens = cached.num_computed_tokens
        out = ModelRunnerOutput()
        for rid, n in so.num_scheduled_tokens.items():
            st = self.states[rid]
            draft = so.scheduled_spec_decode_tokens.get(rid, [])
            tokens = st.token_ids + draft
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            assert end <= len(tokens), (rid, start, n, len(tokens))
            table = st.block_ids[0]
            assert len(table) * bs >= end, f"{rid}: block table too short for {end} tokens"
            for p in range(start, end):
                assert pool.blocks[table[p // bs]].ref_cnt == 1, f"{rid} writes into a shared block"
                self.slots[table[p // bs] * bs + p % bs] = (0, tokens[p])
            for p in range(end):
                assert self.slots.get(table[p // bs] * bs + p % bs) == (0, tokens[p]), f"{rid}: position {p}"
            if end < len(st.token_ids):
                continue
            emitted = []
            for j in range(len(draft) + 1):
                tok = next_token(st.token_ids + emitted)
                emitted.append(tok)
                if j == len(draft) or tok != draft[j]:
                    break
            st.token_ids.extend(emitted)
            out.req_ids.append(rid)
            out.sampled_token_ids.append(emitted)
        return out

    def step(self, failed=None):
        so, changed = super().step(failed)
        if self.draft_fn is not None:
            for req in self.scheduler.running:
                req.spec_token_ids = self.draft_fn(req, self.rng) if req.num_tokens - req.num_computed_tokens == 1 else []
        return so, changed


def _true_continuation(req, n: int) -> list[int]:
    tokens, out = list(req.all_token_ids), []
    for _ in range(n):
        out.append(next_token(tokens))
        tokens.append(out[-1])
    return out


def _noisy_draft(req, rng: random.Random, k: int = 4) -> list[int]:
    """The true continuation with each position wrong with probability 1/3."""
    return [t if rng.random() > 1 / 3 else (t + 1) % 23 + 3 for t in _true_continuation(req, k)]


def _free_queue(s: Scheduler) -> list[int]:
    return s.kv_cache_manager.block_pool.free_block_queue.block_ids()


def _scheduler(**kw) -> Scheduler:
    return Scheduler(make_config(**kw), num_kv_blocks=kw.pop("num_blocks", 12))


def test_rejected_draft_returns_its_block_and_leaves_the_no_speculation_state():
    plain, spec = _scheduler(), _scheduler()
    runners = [SpecFakeRunner(plain), SpecFakeRunner(spec)]
    for s in (plain, spec):
        s.add_request(make_request("a", [5, 6], max_tokens=8))
    for r in runners:
        r.step()  # prefill: 2 prompt tokens, 1 sampled
    req = spec.requests["a"]
    assert (req.num_tokens, req.num_computed_tokens) == (3, 2)
    req.spec_token_ids = [0, 0, 0, 0]  # all wrong: positions 2..6 need a second block
    so, _ = runners[1].step()
    assert so.num_scheduled_tokens == {"a": 5} and so.scheduled_spec_decode_tokens == {"a": [0, 0, 0, 0]}
    runners[0].step()
    for s in (plain, spec):
        r = s.requests["a"]
        assert (r.num_tokens, r.num_computed_tokens) == (4, 3)
    assert spec.kv_cache_manager.get_block_ids(req) == plain.kv_cache_manager.get_block_ids(plain.requests["a"])
    assert _free_queue(spec) == _free_queue(plain)
    assert spec.spec_decoding_stats.num_draft_tokens == 4 and spec.spec_decoding_stats.num_accepted_tokens == 0
    so, _ = runners[1].step()  # the runner dropped the returned block from its table
    assert so.scheduled_cached_reqs[0].num_dropped_blocks == 1
    assert runners[1].states["a"].block_ids[0] == spec.kv_cache_manager.get_block_ids(req)


def test_accepted_drafts_advance_by_accepted_plus_one_and_publish_only_their_blocks():
    s = _scheduler()
    runner = SpecFakeRunner(s)
    s.add_request(make_request("a", [5, 6, 7], max_tokens=12))
    runner.step()
    req = s.requests["a"]
    true = _true_continuation(req, 6)
    req.spec_token_ids = true[:3] + [0, 0, 0]  # 3 accepted, then rejected
    runner.step()
    assert req.num_tokens == 4 + 4 and req.num_computed_tokens == req.num_tokens - 1
    assert req.output_token_ids[1:] == true[:4]
    # published blocks cover accepted tokens only, and hold exactly them
    assert len(req.block_hashes) == req.num_computed_tokens // s.block_size
    pool = s.kv_cache_manager.block_pool
    for i, block_id in enumerate(s.kv_cache_manager.get_block_ids(req)[:len(req.block_hashes)]):
        assert list(pool.blocks[block_id].token_ids) == req.all_token_ids[i * 4:(i + 1) * 4]
    assert len(s.kv_cache_manager.get_block_ids(req)) == cdiv(req.num_computed_tokens, s.block_size)
    s.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_random_drafts_give_the_reference_outputs_and_a_clean_pool(seed):
    """Many requests, small pool (preemption), chunked prefill, prefix sharing, noisy drafts."""
    rng = random.Random(seed)
    s = Scheduler(make_config(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=48), num_kv_blocks=20)
    runner = SpecFakeRunner(s, draft_fn=_noisy_draft, rng=random.Random(seed))
    shared = [rng.randrange(3, 26) for _ in range(8)]
    prompts = {f"r{i}": (shared if i % 2 else []) + [rng.randrange(3, 26) for _ in range(rng.randint(1, 14))]
               for i in range(8)}
    max_tokens = {rid: rng.randint(1, 16) for rid in prompts}
    for rid, p in prompts.items():
        s.add_request(make_request(rid, p, max_tokens=max_tokens[rid]))
    outputs = {}
    for _ in range(400):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        changed = s.update_from_output(so, runner.execute(so))
        s.check_integrity()
        for req in s.running:  # the no-speculation state after every step
            if req.num_tokens - req.num_computed_tokens == 1:
                assert len(s.kv_cache_manager.get_block_ids(req)) == cdiv(req.num_computed_tokens, s.block_size)
                assert len(req.block_hashes) <= req.num_computed_tokens // s.block_size
            req.spec_token_ids = _noisy_draft(req, runner.rng) if req.num_tokens - req.num_computed_tokens == 1 else []
        for req in changed:
            if req.is_finished:
                outputs[req.request_id] = req.output_token_ids
    assert not s.has_unfinished_requests()
    for rid, p in prompts.items():
        assert outputs[rid] == reference_output(p, max_tokens[rid], 48), rid
    assert s.kv_cache_manager.num_used_blocks == 0
    st = s.spec_decoding_stats
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert st.num_accepted_tokens == sum(st.num_accepted_tokens_per_pos)


def test_drafts_fit_the_token_budget_and_max_tokens():
    s = _scheduler(max_num_batched_tokens=6)
    runner = SpecFakeRunner(s)
    for rid in ("a", "b"):
        s.add_request(make_request(rid, [5, 6], max_tokens=3))
    runner.step()
    for rid in ("a", "b"):
        s.requests[rid].spec_token_ids = [9, 9, 9, 9]
    so = s.schedule()
    # max_tokens 3 with 1 out: at most 1 draft each (2 tokens out + 1 more); budget 6 holds both
    assert so.scheduled_spec_decode_tokens == {"a": [9], "b": [9]}
    assert so.num_scheduled_tokens == {"a": 2, "b": 2} and so.total_num_scheduled_tokens == 4


def test_drafts_never_preempt():
    s = Scheduler(make_config(max_num_batched_tokens=64), num_kv_blocks=2)
    runner = SpecFakeRunner(s)
    s.add_request(make_request("a", [5, 6, 7], max_tokens=4))
    s.add_request(make_request("b", [5, 8, 9], max_tokens=4))
    runner.step()
    s.requests["a"].spec_token_ids = [9, 9, 9]  # would need a third block
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {} and so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert not so.preempted_req_ids


def test_a_verify_step_with_too_many_tokens_is_refused():
    s = _scheduler()
    runner = SpecFakeRunner(s)
    s.add_request(make_request("a", [5, 6], max_tokens=8))
    runner.step()
    s.requests["a"].spec_token_ids = [9]
    so = s.schedule()
    with pytest.raises(ValueError, match="1 draft tokens returned 3 tokens"):
        s.update_from_output(so, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[9, 9, 9]]))
