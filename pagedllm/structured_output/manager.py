"""StructuredOutputManager: compiled grammars, one matcher per request, the step's bitmask.

A constrained request: ``add_request`` (compile cache keyed by (tokenizer fingerprint, spec),
one shared future per spec) → ``update_ready`` before ``schedule()`` (compiled: matcher, then
``Scheduler.set_grammar_ready``) → ``grammar_bitmask`` after it → ``accept_tokens`` after
``update_from_output`` (matcher advanced or rolled back to the output). The engine thread calls
every method; only compiles run on the worker thread, which waits on the compile process
(``compile_process.py``: time and memory limits; a compile whose requests all left is stopped).
A request with a ``reasoning_boundary`` samples freely (no bitmask row, no matcher advance) until
its reasoning gate opens; the matcher then sees the output from the gate's ``grammar_start`` on.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.outputs import SchedulerOutput
from pagedllm.core.step_failure import InputError
from pagedllm.structured_output.backend_xgrammar import (GrammarSpec, XgrammarBackend, tokenizer_fingerprint,
                                                          validate_structured_outputs)
from pagedllm.structured_output.reasoning_gate import ReasoningGate
from pagedllm.structured_output.compile_process import CompileCancelled

logger = logging.getLogger("pagedllm")


@dataclass
class GrammarBitmask:
    """Row i of ``bitmask`` (int32 [R, ceil(V/32)]) is for ``req_ids[i]``, a constrained request sampling now;
    a request verifying k drafts has k + 1 rows in a row, one per position (after 0..k drafts)."""

    req_ids: list[str]
    bitmask: np.ndarray


@dataclass
class StepGrammarResult:
    """Requests whose grammar terminated (to end as stop) or rejected a token (to fail)."""

    terminated: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)


@dataclass
class _RequestGrammar:
    spec: GrammarSpec
    future: cf.Future
    matcher: object | None = None
    num_accepted: int = 0  # output tokens the matcher holds, from grammar_start on
    gate: ReasoningGate | None = None
    grammar_start: int | None = 0  # output index where the grammar begins; None: not yet known


class StructuredOutputManager:
    """The backend is built on the worker thread at the first compile; the cache drops least recent first."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_num_seqs: int,
                 max_cache_entries: int = 256, compile_timeout_s: float = 30.0,
                 compile_memory_mb: int | None = 2048) -> None:
        self._compile_limits = (compile_timeout_s, compile_memory_mb)
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._fingerprint: str | None = None
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._executor: cf.ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple[str, GrammarSpec], cf.Future] = OrderedDict()
        self._max_cache_entries = max_cache_entries
        self._requests: dict[str, _RequestGrammar] = {}
        self._pending: dict[str, _RequestGrammar] = {}
        self._bitmask = np.empty((max_num_seqs, (vocab_size + 31) // 32), dtype=np.int32)
        self.num_compiles = 0
        self.compile_seconds: dict[GrammarSpec, float] = {}

    @staticmethod
    def validate(request_params) -> GrammarSpec:
        """Raises ValueError naming the field, also when xgrammar is not installed."""
        try:
            return validate_structured_outputs(request_params.structured_outputs)
        except ImportError as e:
            raise ValueError(f"structured_outputs cannot be served: {e}") from None

    def add_request(self, request: Request, spec: GrammarSpec) -> None:
        """Start (or share) the compile of ``spec`` for a request WAITING_FOR_GRAMMAR."""
        key = (self._tokenizer_key(), spec)
        future = self._cache.get(key)
        if future is None or future.cancelled() or (future.done() and isinstance(future.exception(),
                                                                                CompileCancelled)):
            future = self._submit(spec)
            self._cache[key] = future
            while len(self._cache) > self._max_cache_entries:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        boundary = request.sampling_params.structured_outputs.reasoning_boundary
        state = _RequestGrammar(spec, future)
        if boundary is not None:
            state.gate, state.grammar_start = ReasoningGate(boundary), None
        self._requests[request.request_id] = state
        self._pending[request.request_id] = state

    def remove_requests(self, request_ids) -> None:
        """Forget requests; unknown ids are ignored. A compile no remaining request waits for is
        cancelled (stopped in the compile process if it runs)."""
        left = []
        for rid in request_ids:
            self._requests.pop(rid, None)
            state = self._pending.pop(rid, None)
            if state is not None:
                left.append(state)
        waited = {id(s.future) for s in self._pending.values()}
        for state in left:
            future = state.future
            if id(future) not in waited and not future.done() and not future.cancel() and self._backend:
                self._backend.cancel(state.spec)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def update_ready(self, scheduler, block: bool = False, timeout: float = 0.25) -> dict[str, str]:
        """Make compiled requests admissible; ``block`` waits up to ``timeout`` s when nothing else can run.

        Returns ``{request_id: error}`` of failed compiles, for the caller to end.
        """
        if not self._pending:
            return {}
        if block:
            cf.wait([s.future for s in self._pending.values()], timeout=timeout, return_when=cf.FIRST_COMPLETED)
        failed: dict[str, str] = {}
        for rid, state in list(self._pending.items()):
            if not state.future.done():
                continue
            del self._pending[rid]
            req = scheduler.requests.get(rid)
            if req is None or req.status != RequestStatus.WAITING_FOR_GRAMMAR:
                self._requests.pop(rid, None)  # aborted while compiling
                continue
            error = state.future.exception()
            if error is not None:
                failed[rid] = InputError(f"grammar compile failed: {error}")
                self._requests.pop(rid, None)
                continue
            state.matcher = self._backend.new_matcher(state.future.result())
            if not self._can_start(state.matcher):
                failed[rid] = InputError(f"structured_outputs.{state.spec.kind} admits no output "
                                         "(its language is empty)")
                self._requests.pop(rid, None)
                continue
            scheduler.set_grammar_ready(rid)
        return failed

    def _can_start(self, matcher) -> bool:
        """Whether the grammar allows any first token (a stop token when it accepts the empty string)."""
        matcher.fill_next_token_bitmask(self._bitmask, 0)
        return bool(self._bitmask[0].any())

    def grammar_bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
                        ) -> GrammarBitmask | None:
        """Rows for constrained requests sampling this step, or None; a view valid until the next call."""
        if not self._requests:
            return None
        req_ids = []
        drafts = scheduler_output.scheduled_spec_decode_tokens
        num_rows = len(scheduler_output.num_scheduled_tokens) + sum(len(d) for d in drafts.values())
        if num_rows > len(self._bitmask):
            self._bitmask = np.empty((num_rows, self._bitmask.shape[1]), dtype=np.int32)
        for rid, num in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(rid)
            if state is None or state.matcher is None:
                continue
            req = requests[rid]
            if req.num_computed_tokens + num < req.num_tokens:
                continue  # a prefill chunk that samples nothing
            if state.grammar_start is None:  # the reasoning gate is not open: never drafted
                if self._fill_gate_row(state, req, len(req_ids)):
                    req_ids.append(rid)
            elif not state.matcher.is_terminated():
                self._fill_rows(state.matcher, drafts.get(rid, ()), len(req_ids))
                req_ids.extend([rid] * (len(drafts.get(rid, ())) + 1))
        if not req_ids:
            return None
        return GrammarBitmask(req_ids, self._bitmask[:len(req_ids)])

    def _fill_gate_row(self, state: _RequestGrammar, req: Request, row: int) -> bool:
        """Fill bitmask row ``row`` while the reasoning gate is closed; False: the token is free."""
        tokens, with_grammar = state.gate.allowed_tokens(req.output_token_ids)
        if not tokens:
            return False  # inside the reasoning: free
        if with_grammar:
            state.matcher.fill_next_token_bitmask(self._bitmask, row)
        else:
            self._bitmask[row] = 0
        words = self._bitmask.view(np.uint32)
        for t in tokens:
            words[row, t // 32] |= np.uint32(1 << (t % 32))
        return True

    def _fill_rows(self, matcher, draft, first_row: int) -> None:
        """Rows ``first_row``.. for the positions after 0..k draft tokens; the matcher ends as it began."""
        num_accepted = 0
        for j in range(len(draft) + 1):
            matcher.fill_next_token_bitmask(self._bitmask, first_row + j)
            if j < len(draft) and num_accepted == j and matcher.accept_token(draft[j]):
                num_accepted += 1
        matcher.rollback(num_accepted)

    def validate_drafts(self, requests) -> None:
        """Cut each constrained request's ``spec_token_ids`` before the first token its grammar
        rejects (none after one that terminates it, none while its reasoning gate is closed);
        matchers are left as they were."""
        for req in requests:
            state = self._requests.get(req.request_id)
            if state is None or not req.spec_token_ids:
                continue
            matcher, num_valid = state.matcher, 0
            if state.grammar_start is None:
                pass  # still reasoning under a gate: the gate reads whole outputs, so no drafts
            elif matcher is not None:
                for tok in req.spec_token_ids:
                    if matcher.is_terminated() or not matcher.accept_token(tok):
                        break
                    num_valid += 1
                matcher.rollback(num_valid)
            req.spec_token_ids = req.spec_token_ids[:num_valid]

    def accept_tokens(self, updated: list[Request]) -> StepGrammarResult:
        """Sync each matcher with its request's output; finished requests are then forgotten."""
        result = StepGrammarResult()
        for req in updated:
            state = self._requests.get(req.request_id)
            if state is None or state.matcher is None:
                continue
            error = self._sync(state, req.output_token_ids)
            if error is not None:
                result.rejected[req.request_id] = error
            elif state.matcher.is_terminated() and not req.is_finished:
                result.terminated.append(req.request_id)
            if req.is_finished or error is not None or req.request_id in result.terminated:
                del self._requests[req.request_id]
        return result

    @staticmethod
    def _sync(state: _RequestGrammar, output_token_ids: list[int]) -> str | None:
        """Advance or roll back the matcher to the output; an error string if a token is rejected."""
        matcher = state.matcher
        begin = state.grammar_start
        if begin is not None and state.gate is not None and len(output_token_ids) < begin:
            begin = None  # rolled back into the reasoning: the gate searches again
            state.gate.reset()
        num_held = len(output_token_ids) - begin if begin is not None else 0
        if state.num_accepted > num_held:
            matcher.rollback(state.num_accepted - num_held)
            state.num_accepted = num_held
        if begin is None:
            begin = state.gate.grammar_start(output_token_ids)
        state.grammar_start = begin
        if begin is None:
            return None  # still reasoning
        for tok in output_token_ids[begin + state.num_accepted:]:
            if matcher.is_terminated():
                break  # the request is being ended
            if not matcher.accept_token(tok):
                return f"token {tok} at output position {begin + state.num_accepted} violates the grammar"
            state.num_accepted += 1
        return None

    def _tokenizer_key(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = tokenizer_fingerprint(self._tokenizer, self.vocab_size, self._stop_token_ids)
        return self._fingerprint

    def _submit(self, spec: GrammarSpec) -> cf.Future:
        if self._executor is None:
            # compiles are rare; the step loop needs the cores
            self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-grammar")
        self.num_compiles += 1
        return self._executor.submit(self._compile, spec)

    def _compile(self, spec: GrammarSpec):
        backend = self.backend()
        t0 = time.perf_counter()
        compiled = backend.compile(spec)
        self.compile_seconds[spec] = time.perf_counter() - t0
        logger.debug("compiled %s grammar in %.3f s", spec.kind, self.compile_seconds[spec])
        return compiled

    def backend(self) -> XgrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = XgrammarBackend(self._tokenizer, self.vocab_size, self._stop_token_ids,
                                                *self._compile_limits)
            return self._backend

    def shutdown(self) -> None:
        """Stop the compile thread and process, cancelling pending compiles."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if self._backend is not None:
            self._backend.close()
