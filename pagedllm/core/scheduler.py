"""Scheduler: which requests run each step and how many tokens each computes, under a
:class:`StepBudget` (vLLM v1's scheduler); memory only through the :class:`KVCacheManager`.
Policies: ``docs/scheduler.md``. Not thread-safe: one thread alternates ``schedule()`` and
``update_from_output()``."""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from typing import Iterable, NamedTuple, Sequence

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_groups import KVCacheGroupSpec, cdiv
from pagedllm.core.kv_cache_manager import GroupBlockIds, KVCacheManager, TierHit
from pagedllm.core.kv_offload import KVOffloadSpec, tier_hit_counts
from pagedllm.core.step_budget import StepBudget
from pagedllm.core.step_cost import StepCostModel, StepShape, attention_pairs
from pagedllm.core.swap_space import PREEMPT_SWAP, SwapSpace
from pagedllm.core.kv_snapshot import (EVENT_EVICTED, EVENT_PREEMPTED, EVENT_PREFIX_HIT, EVENT_RESUMED,
                                       KVCacheSnapshot, KVEventLog, RequestKVRow)
from pagedllm.core.outputs import (CachedRequestData, KVTransferOps, ModelRunnerOutput, NewRequestData,
                                   SchedulerOutput)
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.spec_decode_stats import SpecDecodingStats
from pagedllm.core.stats import SchedulerStats

logger = logging.getLogger("pagedllm")


class _PrefixHit(NamedTuple):
    block_ids: GroupBlockIds
    num_pool_tokens: int
    tier_hits: list[TierHit]
    num_tokens: int  # pool + tiers


class Scheduler:
    """Continuous-batching scheduler with chunked prefill, prefix caching and preemption.
    ``record_trace`` keeps ``step_trace``, one ``{request_id: num_tokens}`` per step (unbounded:
    tests). ``kv_cache_groups`` default: one full-attention group; ``swap_space`` default: none
    (swap falls back to recompute). ValueError when ``config.max_model_len`` is None.
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int, record_trace: bool = False,
                 kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None, num_kv_events: int = 100,
                 kv_offload: KVOffloadSpec | None = None, swap_space: SwapSpace | None = None) -> None:
        if config.max_model_len is None:
            raise ValueError("config.max_model_len must be resolved before building the Scheduler")
        self.config = config
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.token_budget = config.token_budget
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.step_cost = StepCostModel()  # fed by observe_step_time
        self.is_priority = config.scheduling_policy == "priority"
        self.is_static = config.batching == "static"
        self.kv_cache_manager = KVCacheManager(num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                               config.max_model_len, kv_cache_groups, kv_offload)
        self.requests: dict[str, Request] = {}  # unfinished
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0
        self.swap_space = swap_space if swap_space is not None else SwapSpace(0, config.preemption_mode)
        self._swap_ops = KVTransferOps()
        self.kv_events = KVEventLog(num_kv_events)
        self.step_trace: list[dict[str, int]] | None = [] if record_trace else None
        self._groups: dict[str, list[Request]] = {}  # parent_id -> unfinished children
        self._arrival_seq: dict[str, int] = {}  # tie-breaker for equal arrival times
        self._next_seq = 0
        self._known_to_runner: set[str] = set()  # scheduled since (re)admission
        self._finished_req_ids: set[str] = set()  # runner state to drop next step
        self._num_dropped_blocks: dict[str, int] = {}  # rejected drafts' blocks the runner still lists
        self.spec_decoding_stats = SpecDecodingStats()

    def add_request(self, request: Request) -> None:
        """Queue ``request``. ValueError for a duplicate id, an empty or too long prompt, a worst
        case (prompt + max_tokens) larger than the pool, or a child's prompt unlike its siblings'."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in the scheduler")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty (at least one token is needed)")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens is longer than "
                             f"max_model_len ({self.max_model_len})")
        kv = self.kv_cache_manager
        worst = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        needed = kv.max_num_blocks_per_seq(worst, worst if self.is_static else self.token_budget)
        if needed > kv.num_total_blocks:
            raise ValueError(f"request {rid!r}: {worst} tokens (prompt {request.num_prompt_tokens} + max_tokens "
                             f"{request.max_tokens}, capped at max_model_len {self.max_model_len}) need "
                             f"{needed} KV blocks of {self.block_size} tokens, but the pool has "
                             f"only {kv.num_total_blocks}")
        if request.parent_id is not None:
            siblings = self._groups.setdefault(request.parent_id, [])
            if siblings and siblings[0].prompt_token_ids != request.prompt_token_ids:
                raise ValueError(f"request {rid!r}: children of {request.parent_id!r} must share one prompt")
            siblings.append(request)
        request.status = (RequestStatus.WAITING_FOR_GRAMMAR if request.use_structured_output
                          else RequestStatus.WAITING)
        self.requests[rid] = request
        self._arrival_seq[rid] = self._next_seq
        self._next_seq += 1
        if self.is_priority:
            bisect.insort(self.waiting, request, key=self._priority_key)
        else:
            self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        """This step's batch: admits (RUNNING, ``num_computed_tokens`` at the prefix hit), allocates
        slots, may preempt; ``update_from_output`` advances ``num_computed_tokens``."""
        # No prefill or decode phase: each request has num_computed_tokens and num_tokens, and
        # each step lets the first catch up with the second under the StepBudget (tokens, prompt
        # cap and time while decoding, partial-prefill slots). One rule for prefill, chunked
        # prefill, prefix hits, resumption and decode (vLLM v1). Policies: docs/scheduler.md.
        # 1. Running requests, decodes first; when blocks run out, the lowest-priority one is
        #    preempted and gives its share back.
        # 2. Waiting requests in queue order from their prefix hit; the first that cannot be
        #    admitted ends the phase (no bypass) unless a rule skips it.
        # 3. The output for the model runner.
        budget = StepBudget.for_step(self.config, self.step_cost, self._is_decoding())
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, GroupBlockIds] = {}
        preempted: list[Request] = []
        drafts: dict[str, list[int]] = {}  # draft tokens scheduled for verification

        # 1. Running requests.
        for req in sorted(self.running, key=lambda r: len(r.all_token_ids) - r.num_computed_tokens > 1):
            if budget.num_tokens_left == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_left = len(req.all_token_ids) - req.num_computed_tokens
            is_prompt = num_left > 1
            limit = budget.prompt_limit(num_left, req.num_computed_tokens) if is_prompt else budget.num_tokens_left
            num_new = self._chunk(num_left, limit)
            if num_new is None or num_new <= 0:
                continue
            if is_prompt and budget.partial_refusal(num_left, num_new):
                continue  # no partial-prefill slot: keeps its blocks, runs next step
            draft, block_ids = ([], None) if is_prompt else self._allocate_draft(req, budget)
            if block_ids is None:
                block_ids = self._allocate_or_preempt(req, num_new, budget, num_scheduled, new_block_ids, preempted)
            if block_ids is None:
                break
            num_scheduled[req.request_id] = num_new + len(draft)
            new_block_ids[req.request_id] = block_ids
            if draft:
                drafts[req.request_id] = draft
            if is_prompt:
                budget.take_prompt(req.request_id, num_new, req.num_computed_tokens, num_left)
            else:
                budget.take_decode(req.request_id, req.num_computed_tokens, len(draft))

        # 2. Waiting requests.
        can_admit = not preempted and not (self.is_static and self.running)
        i = 0
        loras = {r.lora_int_id for r in self.running} - {0}
        while can_admit and i < len(self.waiting) and budget.has_prompt_room and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            if req.status == RequestStatus.WAITING_FOR_GRAMMAR or self._lacks_lora_slot(req, loras):
                i += 1  # skipped, not blocking
                continue
            swapped = self.swap_space.swapped.get(req.request_id)
            if swapped is not None:
                num_new = min(req.num_tokens - swapped.num_computed_tokens, budget.num_tokens_left)
                if not self._admit_swapped(req, swapped, num_new):
                    break
                num_scheduled[req.request_id] = num_new
                budget.take_tokens(req.request_id, num_new)
                loras |= {req.lora_int_id} - {0}
                continue
            donor = None
            if req.parent_id is not None and not self.is_static:
                donor, is_held = self._find_sibling_donor(req)
                if is_held:  # a sibling computes the shared prompt: skipped, not blocking
                    i += 1
                    continue
            hit = self._prefix_hit(req, donor)
            num_left = req.num_tokens - hit.num_tokens
            limit = budget.prompt_limit(num_left, hit.num_tokens)
            if limit <= 0:
                break
            num_new = self._chunk(num_left, limit)
            if num_new is None:
                break  # chunked prefill off: admitted whole or not at all
            refusal = budget.partial_refusal(num_left, num_new)
            if refusal == "long":  # shorter prompts may pass it
                i += 1
                continue
            if refusal or not self._admit(req, i, num_new, hit):
                break
            num_scheduled[req.request_id] = num_new
            budget.take_prompt(req.request_id, num_new, hit.num_tokens, num_left)
            loras |= {req.lora_int_id} - {0}

        # 3. The output for the model runner.
        for victim in preempted:  # a draft of a request preempted after it was scheduled
            drafts.pop(victim.request_id, None)
        return self._make_output(num_scheduled, new_block_ids, preempted, budget, drafts)

    def _allocate_draft(self, req: Request, budget: StepBudget) -> tuple[list[int], GroupBlockIds | None]:
        """(the part of ``req.spec_token_ids`` that fits, slots for it and the last token) or
        ``([], None)``: a draft fits the token budget, ``max_tokens`` and ``max_model_len`` and
        free blocks, and never preempts anyone."""
        num_fit = min(len(req.spec_token_ids), budget.num_tokens_left - 1,
                      req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1,
                      self._num_draft_slots(req))
        if num_fit <= 0:
            return [], None
        draft = req.spec_token_ids[:num_fit]
        block_ids = self._allocate(req, 1 + num_fit)
        return (draft, block_ids) if block_ids is not None else ([], None)

    def _num_draft_slots(self, req: Request) -> int:
        """Draft tokens ``req`` can take while the pool keeps a block per running request (what
        each may need this step), so drafts never push anyone into preemption."""
        kv = self.kv_cache_manager
        num_spare = (kv.num_free_or_evictable_blocks // kv.num_groups) - len(self.running)
        num_held = len(kv.get_block_ids(req))
        return (num_held + max(num_spare, 0)) * self.block_size - req.num_computed_tokens - 1

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance ``num_computed_tokens``, publish full blocks, append tokens, check stops, free
        finished and failed requests. Returns those that got tokens or finished (batch order);
        ValueError when the runner sampled mid-prefill or not for a complete request."""
        kv = self.kv_cache_manager
        sampled = dict(zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids))
        failed = model_runner_output.failed
        drafts = scheduler_output.scheduled_spec_decode_tokens
        changed: list[Request] = []
        any_finished = False
        for rid, num_tokens in scheduler_output.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING or rid in model_runner_output.retried:
                continue  # aborted or finished between schedule() and now, or run again next step
            num_draft = len(drafts.get(rid, ()))
            # drafts count once verified: the accepted ones are added below, after their tokens
            num_computed = req.num_computed_tokens = req.num_computed_tokens + num_tokens - num_draft
            req.spec_token_ids = []
            if rid in failed:
                self._finish(req, RequestStatus.FINISHED_ERROR, in_running=True)
                changed.append(req)
                any_finished = True
                continue
            kv.cache_blocks(req)
            token_ids = sampled.get(rid)
            is_complete = num_computed == len(req.all_token_ids)
            if not token_ids:
                if is_complete:
                    raise ValueError(f"request {rid!r} computed all {req.num_tokens} tokens but the runner "
                                     f"sampled nothing for it")
                continue
            if not is_complete:
                raise ValueError(f"runner sampled for request {rid!r} mid-prefill "
                                 f"({req.num_computed_tokens} of {req.num_tokens} tokens computed)")
            if req.first_token_time is None:
                req.first_token_time = time.time()
            if num_draft:
                self._observe_draft(req, num_draft, token_ids)
            for token_id in token_ids:
                req.append_output_token_ids([token_id])
                if self._check_stop(req, token_id):
                    kv.free(req)
                    self._forget(req)
                    any_finished = True
                    break
            if num_draft and not req.is_finished:
                self._settle_draft(req, len(token_ids) - 1)
            changed.append(req)
        if model_runner_output.failed_tier_keys and kv.offload is not None:
            kv.offload.forget(model_runner_output.failed_tier_keys)
        for rid in failed:
            req = self.requests.get(rid)
            if req is not None and rid not in scheduler_output.num_scheduled_tokens:
                self._finish(req, RequestStatus.FINISHED_ERROR, in_running=req.status == RequestStatus.RUNNING)
                changed.append(req)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return changed

    def _observe_draft(self, req: Request, num_draft: int, token_ids: list[int]) -> None:
        if not 1 <= len(token_ids) <= num_draft + 1:
            raise ValueError(f"request {req.request_id!r}: a verify step of {num_draft} draft tokens returned "
                             f"{len(token_ids)} tokens (1 to {num_draft + 1} expected)")
        num_accepted = len(token_ids) - 1
        req.num_draft_tokens += num_draft
        req.num_accepted_tokens += num_accepted
        self.spec_decoding_stats.observe(num_draft, num_accepted)

    def _settle_draft(self, req: Request, num_accepted: int) -> None:
        """After a verify step: the accepted drafts' K/V counts as computed and may be published;
        blocks only the rejected ones used go back to the pool (their slots are rewritten later)."""
        kv = self.kv_cache_manager
        req.num_computed_tokens += num_accepted
        kv.cache_blocks(req)
        num_dropped = kv.free_tail_blocks(req, req.num_computed_tokens)
        if num_dropped:
            self._num_dropped_blocks[req.request_id] = self._num_dropped_blocks.get(req.request_id, 0) + num_dropped

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> list[Request]:
        """End requests in any state with ``finished_status``, freeing their blocks; unknown ids are
        ignored. Returns those ended; ValueError for a status that is not FINISHED_*."""
        if not finished_status.is_finished:
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status!r}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ended = []
        for rid in ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._finish(req, finished_status, in_running=req.status == RequestStatus.RUNNING)
            ended.append(req)
        return ended

    def abort_request(self, request_ids: str | Iterable[str]) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def set_grammar_ready(self, request_id: str) -> None:
        """WAITING_FOR_GRAMMAR → WAITING; any other request is left alone."""
        req = self.requests.get(request_id)
        if req is not None and req.status == RequestStatus.WAITING_FOR_GRAMMAR:
            req.status = RequestStatus.WAITING

    def has_finished_requests(self) -> bool:
        return bool(self._finished_req_ids)

    def recompute_failed_loads(self, failed_loads: list[tuple[str, bytes, int]]) -> list[str]:
        """Tier reads into ``(tier, key, block_id)`` failed: the tiers forget the keys and the
        running requests holding those blocks are preempted to recompute. Returns their ids."""
        kv = self.kv_cache_manager
        if kv.offload is not None:
            kv.offload.forget([(tier, key) for tier, key, _ in failed_loads])
        block_ids = {b for _, _, b in failed_loads}
        victims = [r for r in self.running if block_ids.intersection(kv.get_block_ids(r))]
        for req in victims:
            self._preempt(req, mode="recompute")
            if req.num_cached_tokens >= 0 and not req.output_token_ids:  # report the hit it really gets
                req.num_cached_tokens, req.cached_tokens_by_tier = -1, None
        return [r.request_id for r in victims]

    def reset_runner_state(self) -> None:
        """The runner lost its per-request state: send every request in full from now on."""
        self._known_to_runner.clear()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_preemptions=self.num_preemptions,
            kv_cache_usage=kv.usage, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, num_used_blocks=kv.num_used_blocks,
            num_cached_blocks=kv.num_cached_free_blocks, num_free_blocks=kv.num_free_or_evictable_blocks,
            num_total_blocks=kv.num_total_blocks)

    def check_integrity(self) -> None:
        """AssertionError unless the KV cache is consistent and each unfinished request sits in one
        queue with a matching status, blocks only while running."""
        kv = self.kv_cache_manager
        kv.check_integrity()
        self.swap_space.check_integrity()
        for rid in self.swap_space.swapped:
            assert self.requests[rid].status == RequestStatus.PREEMPTED, f"{rid} holds swap slots but is not preempted"
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        counts = Counter(running_ids + waiting_ids)
        assert all(c == 1 for c in counts.values()), f"a request is queued twice: {counts.most_common(3)}"
        assert set(counts) == set(self.requests), "queues and the request map disagree"
        assert len(self.running) <= self.max_num_seqs, f"{len(self.running)} running > max_num_seqs"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, f"{r} is in running"
            assert r.num_computed_tokens <= r.num_tokens <= self.max_model_len, f"{r} overflows"
            assert len(kv.get_block_ids(r)) * self.block_size >= r.num_computed_tokens, f"{r} lacks blocks"
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR,
                                RequestStatus.PREEMPTED), f"{r} is in waiting"
            assert r.num_computed_tokens == 0, f"waiting {r} has computed tokens"
        assert set(kv.req_to_blocks) <= set(running_ids), "a request that is not running holds blocks"
        for parent_id, children in self._groups.items():
            assert children and all(c.request_id in self.requests for c in children), f"group {parent_id} stale"

    def kv_cache_snapshot(self, num_steps: int = 0) -> KVCacheSnapshot:
        """Every block's state and unfinished request's block tables; call between steps."""
        kv = self.kv_cache_manager
        rows = [self._kv_row(r, "running") for r in self.running]
        rows += [self._kv_row(r, "preempted" if r.status == RequestStatus.PREEMPTED else "waiting")
                 for r in self.waiting]
        return KVCacheSnapshot.from_states(
            kv.block_states(), time=time.time(), num_steps=num_steps, block_size=self.block_size,
            kv_cache_groups=[{"layer_ids": list(g.layer_ids), "sliding_window": g.sliding_window}
                             for g in kv.kv_cache_groups],
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_evicted_blocks=kv.num_evicted_blocks, num_preemptions=self.num_preemptions,
            num_running=len(self.running), num_waiting=len(self.waiting), requests=rows,
            events=list(self.kv_events.events))

    def _kv_row(self, req: Request, status: str) -> RequestKVRow:
        kv = self.kv_cache_manager
        tables = [list(t) for t in kv.get_group_block_ids(req)] if req.request_id in kv.req_to_blocks else []
        null_id = kv.null_block.block_id if kv.null_block is not None else None
        return RequestKVRow(req.request_id, status, [b for t in tables for b in t if b != null_id], tables,
                            req.num_prompt_tokens, req.num_output_tokens, req.num_computed_tokens,
                            max(req.num_cached_tokens, 0), req.num_preemptions)

    def _allocate(self, req: Request, *args) -> list[int] | None:
        kv = self.kv_cache_manager
        evicted = kv.num_evicted_blocks
        block_ids = kv.allocate_slots(req, *args)
        if kv.num_evicted_blocks > evicted:
            num = kv.num_evicted_blocks - evicted
            self.kv_events.record(EVENT_EVICTED, req.request_id, num, num * self.block_size)
        return block_ids

    def _cached_tokens_by_tier(self, num_pool_tokens: int, tier_hits: list) -> dict[str, int]:
        counts = tier_hit_counts(tier_hits)
        return {"pool": num_pool_tokens, **{t: n * self.block_size for t, n in counts.items()}}

    def _log_admission(self, req: Request, num_hit_tokens: int, tier_hits: list = ()) -> None:
        for tier, num_blocks in tier_hit_counts(tier_hits).items():
            if num_blocks:
                logger.info("request %s: %d prompt tokens from the %s tier", req.request_id,
                            num_blocks * self.block_size, tier)
        if num_hit_tokens:
            self.kv_events.record(EVENT_PREFIX_HIT, req.request_id, num_hit_tokens // self.block_size, num_hit_tokens)
        if req.num_preemptions:
            self.kv_events.record(EVENT_RESUMED, req.request_id, self.kv_cache_manager.num_held_blocks(req),
                                  req.num_tokens)

    def _priority_key(self, req: Request) -> tuple:
        return (req.priority, req.arrival_time, self._arrival_seq[req.request_id])

    def _step_shape(self, num_scheduled: dict[str, int], drafts: dict[str, list[int]]) -> StepShape:
        """A verify row counts as one decode token and its drafts as prefill tokens."""
        num_decode = num_prefill = num_pairs = 0
        for rid, n in num_scheduled.items():
            num_pairs += attention_pairs(self.requests[rid].num_computed_tokens, n)
            if n == 1 or rid in drafts:
                num_decode += 1
                num_prefill += n - 1
            else:
                num_prefill += n
        return StepShape(num_decode, num_prefill, num_pairs)

    def observe_step_time(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """Feed the step-cost model a step's wall time."""
        if scheduler_output.step_shape is not None:
            self.step_cost.observe(scheduler_output.step_shape, seconds)

    def _pick_victim(self) -> Request:
        """Lowest priority (largest value), then latest arrival."""
        if self.is_priority:
            return max(self.running, key=self._priority_key)
        return max(self.running, key=lambda r: (r.arrival_time, self._arrival_seq[r.request_id]))

    def _preempt(self, req: Request, mode: str | None = None) -> None:
        """Free ``req``'s blocks (swapped out first when the mode picks swap) and queue it at the head."""
        kv = self.kv_cache_manager
        self.kv_events.record(EVENT_PREEMPTED, req.request_id, kv.num_held_blocks(req), req.num_computed_tokens)
        forced, mode, num_blocks = mode, mode or "recompute", cdiv(req.num_computed_tokens, self.block_size)
        if kv.num_groups == 1 and forced is None:  # freed sliding-window blocks cannot be swapped back
            mode = self.swap_space.choose_mode(req.num_computed_tokens, num_blocks)
        if mode == PREEMPT_SWAP:
            slots = self.swap_space.swap_out(req.request_id, num_blocks, req.num_computed_tokens)
            self._swap_ops.swap_out.extend(zip(kv.get_block_ids(req)[:num_blocks], slots))
        req.preemption_modes.append(mode)
        logger.info("request %s preempted by %s: %d tokens computed, %d blocks", req.request_id, mode,
                    req.num_computed_tokens, kv.num_held_blocks(req))
        self.running.remove(req)
        self.kv_cache_manager.free(req)
        self._num_dropped_blocks.pop(req.request_id, None)
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        if req.request_id in self._known_to_runner:
            self._known_to_runner.discard(req.request_id)
            self._finished_req_ids.add(req.request_id)
        if self.is_priority:
            bisect.insort(self.waiting, req, key=self._priority_key)
        else:
            self.waiting.insert(0, req)

    def _is_decoding(self) -> bool:
        return any(len(r.all_token_ids) - r.num_computed_tokens == 1 for r in self.running)

    def _chunk(self, num_left: int, limit: int) -> int | None:
        """None: too many, chunked prefill off."""
        if num_left <= limit:
            return num_left
        return limit if self.enable_chunked_prefill else None

    def _allocate_or_preempt(self, req: Request, num_new: int, budget: StepBudget, num_scheduled: dict[str, int],
                             new_block_ids: dict[str, GroupBlockIds], preempted: list[Request]) -> GroupBlockIds | None:
        """Slots for ``num_new`` tokens of ``req``, preempting (and unscheduling) victims until they
        fit; None when ``req`` itself was preempted."""
        while (block_ids := self._allocate(req, num_new)) is None:
            victim = self._pick_victim()
            if num_scheduled.pop(victim.request_id, None) is not None:
                new_block_ids.pop(victim.request_id)
                budget.give_back(victim.request_id)
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return None
        return block_ids

    def _prefix_hit(self, req: Request, donor: Request | None) -> _PrefixHit:
        kv = self.kv_cache_manager
        block_ids, num_pool_tokens = kv.get_computed_blocks(req)
        if donor is not None:
            shared_ids, num_shared = kv.get_shared_prefix_blocks(req, donor)
            if num_shared > num_pool_tokens:
                block_ids, num_pool_tokens = shared_ids, num_shared
        tier_hits = kv.get_tier_hits(req, num_pool_tokens // self.block_size)
        return _PrefixHit(block_ids, num_pool_tokens, tier_hits, num_pool_tokens + len(tier_hits) * self.block_size)

    def _admit(self, req: Request, index: int, num_new: int, hit: _PrefixHit) -> bool:
        """Move ``self.waiting[index]`` to running after its ``hit``; False (no change) without memory."""
        lookahead = 0
        if self.is_static:  # the worst case now: the batch never grows
            worst = min(req.num_prompt_tokens + req.max_tokens, self.max_model_len)
            lookahead = max(0, worst - hit.num_tokens - num_new)
        if self._allocate(req, num_new, hit.block_ids, hit.num_pool_tokens, lookahead, hit.tier_hits) is None:
            return False
        self._log_admission(req, hit.num_tokens, hit.tier_hits)
        self.waiting.pop(index)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = hit.num_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = hit.num_tokens
            req.cached_tokens_by_tier = self._cached_tokens_by_tier(hit.num_pool_tokens, hit.tier_hits)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()
        self.running.append(req)
        return True

    def _admit_swapped(self, req: Request, record, num_new: int) -> bool:
        """Admit a swapped-out request; False (no change) without memory."""
        block_ids = self._allocate(req, num_new, (), 0, 0, (), record.num_computed_tokens)
        if block_ids is None:
            return False
        self.swap_space.release(req.request_id)
        self._swap_ops.swap_in.extend(zip(record.slots, block_ids[0]))
        self._log_admission(req, 0)
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = record.num_computed_tokens
        self.running.append(req)
        return True

    def _lacks_lora_slot(self, req: Request, loras: set[int]) -> bool:
        """Whether ``req``'s adapter would be one more than ``max_loras`` among the running requests'."""
        lora_id = req.lora_int_id
        return lora_id != 0 and lora_id not in loras and len(loras) >= self.config.max_loras

    def _make_output(self, num_scheduled: dict[str, int], new_block_ids: dict[str, GroupBlockIds],
                     preempted: list[Request], budget: StepBudget, drafts: dict[str, list[int]]) -> SchedulerOutput:
        kv = self.kv_cache_manager
        out = SchedulerOutput(num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=budget.num_scheduled_tokens,
                              step_shape=self._step_shape(num_scheduled, drafts), scheduled_spec_decode_tokens=drafts)
        for rid in num_scheduled:
            req = self.requests[rid]
            num_dropped = self._num_dropped_blocks.pop(rid, 0)
            if rid in self._known_to_runner:
                out.scheduled_cached_reqs.append(CachedRequestData(rid, new_block_ids[rid], req.num_computed_tokens,
                                                                   num_dropped))
            else:
                out.scheduled_new_reqs.append(NewRequestData(
                    rid, list(req.all_token_ids), req.num_prompt_tokens, req.sampling_params,
                    kv.get_group_block_ids(req), req.num_computed_tokens))
                self._known_to_runner.add(rid)
        out.preempted_req_ids = {r.request_id for r in preempted}
        if kv.offload is not None:
            out.kv_transfers = kv.offload.take_ops()
        out.kv_transfers.swap_out, out.kv_transfers.swap_in = self._swap_ops.swap_out, self._swap_ops.swap_in
        self._swap_ops = KVTransferOps()
        out.finished_req_ids = self._finished_req_ids
        self._finished_req_ids = set()
        if self.step_trace is not None:
            self.step_trace.append(dict(num_scheduled))
        return out

    def _find_sibling_donor(self, req: Request) -> tuple[Request | None, bool]:
        """(a running sibling holding the prompt's blocks or None, whether one still computes them)."""
        num_shareable = min(req.num_prompt_tokens, req.num_tokens - 1) // self.block_size * self.block_size
        if num_shareable == 0 or req.sampling_params.prompt_logprobs is not None:
            return None, False
        is_held = False
        for sibling in self._groups.get(req.parent_id, ()):
            if sibling is req or sibling.status != RequestStatus.RUNNING:
                continue
            if sibling.num_computed_tokens >= num_shareable:
                return sibling, False
            is_held = True
        return None, is_held

    def _check_stop(self, req: Request, token_id: int) -> bool:
        params = req.sampling_params
        num_output = len(req.output_token_ids)
        if num_output >= params.min_tokens:
            if token_id == req.eos_token_id and not params.ignore_eos:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if params.stop_token_ids and token_id in params.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token_id
                return True
        if num_output >= req.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _finish(self, req: Request, status: RequestStatus, in_running: bool) -> None:
        if in_running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv_cache_manager.free(req)
        self._forget(req)

    def _forget(self, req: Request) -> None:
        rid = req.request_id
        del self.requests[rid]
        del self._arrival_seq[rid]
        self._num_dropped_blocks.pop(rid, None)
        self.swap_space.release(rid)
        if rid in self._known_to_runner:
            self._known_to_runner.discard(rid)
            self._finished_req_ids.add(rid)
        if req.parent_id is not None:
            siblings = self._groups[req.parent_id]
            siblings.remove(req)
            if not siblings:
                del self._groups[req.parent_id]
