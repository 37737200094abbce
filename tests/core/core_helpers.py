"""Test helpers for the core: request/config factories and a fake model runner.

``FakeRunner`` plays the model runner's side of the ``pagedllm.core.outputs`` contract
without a model: it keeps per-request token ids and block tables from the
SchedulerOutputs alone, "writes K/V" (the token id) into a slot store through the block
table, and before sampling checks that every position of the sequence reads back the
right token through the block table — so a wrong prefix hit, a block handed out while
still in use, or a write into a shared block is caught where it happens. The sampled
token is a deterministic function of the sequence (like greedy decoding), so outputs
can be compared against a reference run.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

EOS = 2
_clock = itertools.count()


def make_config(**kw) -> EngineConfig:
    base = dict(block_size=4, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8)
    base.update(kw)
    return EngineConfig(**base)


def make_request(rid: str, prompt: list[int], max_tokens: int = 4, *, priority: int = 0,
                 arrival_time: float | None = None, parent_id: str | None = None, **sp) -> Request:
    sp.setdefault("ignore_eos", True)
    params = SamplingParams(max_tokens=max_tokens, **sp)
    t = float(next(_clock)) if arrival_time is None else arrival_time  # distinct, increasing
    return Request(rid, prompt, params, eos_token_id=EOS, arrival_time=t, priority=priority, parent_id=parent_id)


def next_token(tokens: list[int]) -> int:
    """A deterministic 'greedy model': the next token is a function of the sequence."""
    return (tokens[-1] * 7 + len(tokens) * 3 + (tokens[-2] if len(tokens) > 1 else 0)) % 23 + 3


def reference_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    """The scheduler's length rule: sample, then stop once max_tokens are out or the
    sequence holds max_model_len tokens (a prompt of exactly max_model_len still gets
    the one token its last logit gives; that token's K/V is never computed)."""
    tokens = list(prompt)
    out = []
    while True:
        tok = next_token(tokens)
        tokens.append(tok)
        out.append(tok)
        if len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


@dataclass
class _RunnerState:
    token_ids: list[int]
    block_ids: tuple[list[int], ...]  # per KV-cache group
    num_computed_tokens: int


@dataclass
class FakeRunner:
    scheduler: Scheduler
    token_fn: Callable[[list[int]], int] = next_token
    states: dict[str, _RunnerState] = field(default_factory=dict)
    slots: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (group, token id) whose "K/V" is there
    # offload tiers' "bytes": tier -> block hash -> the block's slot contents (saved from the pool)
    tiers: dict[str, dict[bytes, list]] = field(default_factory=dict)
    swap: dict[int, list] = field(default_factory=dict)  # swap slot -> a swapped block's slot contents

    def apply_transfers(self, so: SchedulerOutput) -> None:
        """Swap-outs, saves, loads, swap-ins, drops: the runner's order (KVTransferOps)."""
        bs, ops = self.scheduler.block_size, so.kv_transfers
        for block_id, slot in ops.swap_out:
            self.swap[slot] = [self.slots.get(block_id * bs + o) for o in range(bs)]
        for s in ops.saves:
            self.tiers.setdefault(s.tier, {})[s.key] = [self.slots.get(s.block_id * bs + o) for o in range(bs)]
        for tier, key, block_id in ops.loads:
            for o, got in enumerate(self.tiers[tier][key]):  # KeyError: a load of data never saved
                self.slots[block_id * bs + o] = got
        for slot, block_id in ops.swap_in:
            for o, got in enumerate(self.swap.pop(slot)):  # KeyError: a swap-in of a slot never written
                self.slots[block_id * bs + o] = got
        for tier, key in ops.drops:
            del self.tiers[tier][key]  # KeyError: a drop of an entry the tier never held

    def execute(self, so: SchedulerOutput, failed: dict[str, str] | None = None) -> ModelRunnerOutput:
        bs = self.scheduler.block_size
        pool = self.scheduler.kv_cache_manager.block_pool
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        self.apply_transfers(so)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent as new twice"
            self.states[new.req_id] = _RunnerState(list(new.token_ids), tuple(list(t) for t in new.block_ids),
                                                   new.num_computed_tokens)
        for cached in so.scheduled_cached_reqs:
            st = self.states[cached.req_id]
            assert st.num_computed_tokens == cached.num_computed_tokens, cached
            for table, new_ids in zip(st.block_ids, cached.new_block_ids, strict=True):
                table.extend(new_ids)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        out = ModelRunnerOutput(failed=dict(failed or {}))
        for rid, n in so.num_scheduled_tokens.items():
            st = self.states[rid]
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            assert 0 < n and end <= len(st.token_ids), (rid, start, n, len(st.token_ids))
            groups = self.scheduler.kv_cache_manager.kv_cache_groups
            for g, (table, spec) in enumerate(zip(st.block_ids, groups, strict=True)):
                assert len(table) * bs >= end, f"{rid}: group {g} block table too short for {end} tokens"
                for p in range(start, end):
                    block_id = table[p // bs]
                    # Shared blocks are immutable: a write may only go to a block this request owns alone.
                    assert pool.blocks[block_id].ref_cnt == 1, f"{rid} writes into shared block {block_id}"
                    self.slots[block_id * bs + p % bs] = (g, st.token_ids[p])
                # attention reads the context through the block table: all of it, or the window
                first = 0 if spec.sliding_window is None else max(0, start - spec.sliding_window + 1)
                for p in range(first, end):
                    got = self.slots.get(table[p // bs] * bs + p % bs)
                    assert got == (g, st.token_ids[p]), \
                        f"{rid}: group {g} position {p} reads {got}, expected {(g, st.token_ids[p])}"
            st.num_computed_tokens = end
            if end == len(st.token_ids) and rid not in out.failed:
                tok = self.token_fn(st.token_ids)
                st.token_ids.append(tok)
                out.req_ids.append(rid)
                out.sampled_token_ids.append([tok])
        return out

    def step(self, failed: dict[str, str] | None = None) -> tuple[SchedulerOutput, list[Request]]:
        so = self.scheduler.schedule()
        changed = self.scheduler.update_from_output(so, self.execute(so, failed))
        self.scheduler.check_integrity()
        return so, changed


def run_to_completion(runner: FakeRunner, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while runner.scheduler.has_unfinished_requests():
        assert len(outs) < max_steps, "scheduler made no progress"
        outs.append(runner.step()[0])
    return outs
