"""StructuredOutputManager: compiled grammars, one matcher per request, the step's bitmask.

The engine owns one manager; the scheduler never sees a grammar (it sees the request
status WAITING_FOR_GRAMMAR and ``Scheduler.set_grammar_ready``), and the model runner
gets the step's bitmask as a plain array (:class:`GrammarBitmask`).

Life of a constrained request:

1. ``add_request``: its spec is looked up in the compile cache, keyed by (tokenizer
   fingerprint, spec); a miss submits the compile to the worker thread. Requests with
   the same spec share one compile (a future), whether or not it has finished.
2. ``update_ready`` (each step, before ``schedule()``): requests whose compile finished
   get a matcher and become admissible; failed compiles are reported. A slow compile
   delays only its own request; the batch goes on.
3. ``grammar_bitmask`` (after ``schedule()``): fills one bitmask row per constrained
   request that samples this step.
4. ``accept_tokens`` (after ``update_from_output``): each matcher is synced to its
   request's output: advanced by the new tokens, or rolled back if it is ahead (output
   the engine took back). Requests whose grammar terminated are reported to be ended.

Not thread-safe except the compiles: the engine thread calls every method.
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

logger = logging.getLogger("pagedllm")


@dataclass
class GrammarBitmask:
    """The step's grammar masks: row i of ``bitmask`` (int32 [R, ceil(V/32)]) is for
    ``req_ids[i]``; bit j of word w set = token 32*w + j allowed. Only requests that are
    constrained *and* sample this step have a row."""

    req_ids: list[str]
    bitmask: np.ndarray


@dataclass
class StepGrammarResult:
    """What ``accept_tokens`` found: requests whose grammar terminated (to end as stop), and
    requests whose token the grammar rejected (to fail: the mask was not applied)."""

    terminated: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)


@dataclass
class _RequestGrammar:
    spec: GrammarSpec
    future: cf.Future
    matcher: object | None = None  # xgrammar.GrammarMatcher once compiled
    num_accepted: int = 0  # output tokens the matcher has consumed


class StructuredOutputManager:
    """See the module docstring.

    Args:
        tokenizer, vocab_size, stop_token_ids: as :class:`XgrammarBackend` takes them
            (the backend is built on the worker thread at the first compile: reading the
            vocabulary takes most of a second).
        max_num_seqs: bitmask rows preallocated (a step samples at most this many).
        max_cache_entries: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_num_seqs: int,
                 max_cache_entries: int = 256) -> None:
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
        self._pending: dict[str, _RequestGrammar] = {}  # compiling
        self._bitmask = np.empty((max_num_seqs, (vocab_size + 31) // 32), dtype=np.int32)
        self.num_compiles = 0  # compiles started (cache misses)
        self.compile_seconds: dict[GrammarSpec, float] = {}  # wall time of each compile

    # ------------------------------------------------------------------ requests
    @staticmethod
    def validate(request_params) -> GrammarSpec:
        """Validate ``request_params.structured_outputs`` (see ``validate_structured_outputs``).

        Raises ValueError naming the field, also when xgrammar is not installed.
        """
        try:
            return validate_structured_outputs(request_params.structured_outputs)
        except ImportError as e:
            raise ValueError(f"structured_outputs cannot be served: {e}") from None

    def add_request(self, request: Request, spec: GrammarSpec) -> None:
        """Start (or share) the compile of ``spec`` for ``request`` (status WAITING_FOR_GRAMMAR)."""
        key = (self._tokenizer_key(), spec)
        future = self._cache.get(key)
        if future is None:
            future = self._submit(spec)
            self._cache[key] = future
            while len(self._cache) > self._max_cache_entries:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        state = _RequestGrammar(spec, future)
        self._requests[request.request_id] = state
        self._pending[request.request_id] = state

    def remove_requests(self, request_ids) -> None:
        """Forget requests (finished or aborted); unknown ids are ignored."""
        for rid in request_ids:
            self._requests.pop(rid, None)
            self._pending.pop(rid, None)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def update_ready(self, scheduler, block: bool = False, timeout: float = 0.25) -> dict[str, str]:
        """Make requests whose grammar compiled admissible (``scheduler.set_grammar_ready``).

        ``block``: wait up to ``timeout`` seconds for a compile when nothing else can run
        (instead of spinning). Returns ``{request_id: error}`` for compiles that failed
        (the caller ends those requests).
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

    # ------------------------------------------------------------------ per step
    def grammar_bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
                        ) -> GrammarBitmask | None:
        """Bitmask rows for the constrained requests that sample this step, or None if none do.

        A request samples when this step's tokens bring its KV to all its known tokens
        (``num_computed_tokens + num_scheduled == num_tokens``, the contract of
        ``pagedllm.core.outputs``). The array is a view of a reused buffer: valid until the
        next call.
        """
        if not self._requests:
            return None
        req_ids = []
        for rid, num in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(rid)
            if state is None or state.matcher is None:
                continue
            req = requests[rid]
            if req.num_computed_tokens + num >= req.num_tokens and not state.matcher.is_terminated():
                state.matcher.fill_next_token_bitmask(self._bitmask, len(req_ids))
                req_ids.append(rid)
        if not req_ids:
            return None
        return GrammarBitmask(req_ids, self._bitmask[:len(req_ids)])

    def accept_tokens(self, updated: list[Request]) -> StepGrammarResult:
        """Sync each updated request's matcher with its output; report terminated/rejected ones.

        Finished requests are forgotten after their sync.
        """
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
        """Advance (or roll back) the matcher to ``output_token_ids``; an error string if a token is rejected."""
        matcher = state.matcher
        if state.num_accepted > len(output_token_ids):
            matcher.rollback(state.num_accepted - len(output_token_ids))
            state.num_accepted = len(output_token_ids)
        for tok in output_token_ids[state.num_accepted:]:
            if matcher.is_terminated():
                break  # tokens after termination (the request is being ended) are not the grammar's
            if not matcher.accept_token(tok):
                return f"token {tok} at output position {state.num_accepted} violates the grammar"
            state.num_accepted += 1
        return None

    # ------------------------------------------------------------------ compiles
    def _tokenizer_key(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = tokenizer_fingerprint(self._tokenizer, self.vocab_size, self._stop_token_ids)
        return self._fingerprint

    def _submit(self, spec: GrammarSpec) -> cf.Future:
        if self._executor is None:
            # One thread: compiles are rare and the step loop needs the other core.
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
        """The xgrammar backend, built on first use (thread-safe)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = XgrammarBackend(self._tokenizer, self.vocab_size, self._stop_token_ids)
            return self._backend

    def shutdown(self) -> None:
        """Stop the compile thread (pending compiles are cancelled)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
