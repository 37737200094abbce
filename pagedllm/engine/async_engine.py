"""AsyncLLMEngine: the asyncio front of the synchronous :class:`LLMEngine` for the server.

Design (one owner per piece of state):

- The engine loop runs in **one background thread** that alone touches the
  ``LLMEngine`` (scheduler, KV cache, model, tokenizer: none of them is thread-safe).
  A thread rather than a process because the heavy work, torch kernels, releases the
  GIL, so the asyncio event loop stays responsive (accepting connections, ``/health``,
  streaming other requests) during a long forward pass; the Python parts of a step are
  short. A thread also shares the tokenizer and costs no serialization of outputs. A
  process would isolate crashes better and give the scheduler a core of its own; with
  a 2-core CPU machine and a GIL-releasing model that is not worth the IPC and the
  double memory of the tokenizer.
- The event loop talks to the engine thread through a thread-safe command queue
  (``add``, ``abort``, ``call``, ``stop``), applied at the top of every loop iteration,
  so an abort takes effect before the next step: a cancelled request's KV blocks are
  free within one step.
- Outputs come back once per step through ``loop.call_soon_threadsafe`` and are routed
  to per-request :class:`RequestStream` queues. The engine always runs requests with
  ``RequestOutputKind.DELTA`` (cheap to hand over, and each delta timestamps its tokens
  for the latency metrics); the stream rebuilds CUMULATIVE / FINAL_ONLY outputs when the
  caller asked for those.
- Failure model: an exception inside one step fails only that step's requests (the
  ``LLMEngine`` returns them finished with ``finish_reason="error"`` and ``error`` set).
  If the loop itself dies (``step()`` raises), every pending and future request gets
  :class:`EngineDeadError` at once and :attr:`is_healthy` turns False for good. When the
  last step failed every request it ran, the engine is *degraded*: :meth:`check_health`
  then runs a one-token probe request and reports unhealthy while the probe fails.
- Backpressure: with ``max_waiting_requests`` set, :meth:`add_request` raises
  :class:`EngineOverloadedError` when that many requests already wait to be scheduled
  (HTTP 503), instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedllm.async_engine")

__all__ = ["AsyncLLMEngine", "RequestStream", "EngineDeadError", "EngineOverloadedError",
           "EngineUnhealthyError", "merge_request_output"]


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed or shut down); no request can be served."""


class EngineUnhealthyError(RuntimeError):
    """The engine loop runs but its steps fail (the health probe failed)."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting (``max_waiting_requests``); retry later."""


# ---------------------------------------------------------------------------- outputs
def merge_request_output(acc: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold a DELTA ``RequestOutput`` into an accumulated one (in place when ``acc`` is given).

    Completions are matched by ``CompletionOutput.index`` (a delta carries only the
    sequences with news): text is concatenated, token ids and logprobs appended,
    ``cumulative_logprob`` / ``finish_reason`` / ``stop_reason`` replaced. Returns the
    accumulated output.
    """
    if acc is None:
        acc = copy.copy(delta)
        acc.outputs = [_copy_completion(c) for c in delta.outputs]
        acc.prompt_token_ids = list(delta.prompt_token_ids)
    else:
        acc.finished = delta.finished
        acc.error = delta.error or acc.error
        acc.num_cached_tokens = delta.num_cached_tokens
        acc.metrics = delta.metrics
        by_index = {c.index: c for c in acc.outputs}
        for c in delta.outputs:
            have = by_index.get(c.index)
            if have is None:
                acc.outputs.append(_copy_completion(c))
                continue
            have.text += c.text
            have.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                have.logprobs = (have.logprobs or []) + list(c.logprobs)
            have.cumulative_logprob = c.cumulative_logprob
            have.finish_reason = c.finish_reason
            have.stop_reason = c.stop_reason
        acc.outputs.sort(key=lambda c: c.index)
    if delta.prompt_logprobs is not None:
        acc.prompt_logprobs = list(delta.prompt_logprobs)
    return acc


def _copy_completion(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                            None if c.logprobs is None else list(c.logprobs), c.finish_reason, c.stop_reason)


class RequestStream:
    """The asyncio side of one request: an async iterator of its ``RequestOutput``s.

    Outputs follow the ``output_kind`` the caller set in its SamplingParams. Iteration
    ends after the output with ``finished=True``; it raises :class:`EngineDeadError`
    if the engine dies first. :meth:`abort` (or leaving the iteration early through
    :meth:`aclose`) aborts the request in the engine. Event-loop thread only.
    """

    def __init__(self, request_id: str, output_kind: RequestOutputKind, engine: "AsyncLLMEngine") -> None:
        self.request_id = request_id
        self.output_kind = output_kind
        self.finished = False  # the final output (or an error) has been received
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._acc: RequestOutput | None = None
        self._done = False  # iteration is over

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException) or item.finished:
            self.finished = True
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._done:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._done = True
                raise item
            self._done = item.finished
            out = self._shape(item)
            if out is not None:
                return out
        raise StopAsyncIteration

    def _shape(self, delta: RequestOutput) -> RequestOutput | None:
        if self.output_kind == RequestOutputKind.DELTA:
            return delta
        self._acc = merge_request_output(self._acc, delta)
        if self.output_kind == RequestOutputKind.FINAL_ONLY:
            return self._acc if delta.finished else None
        snapshot = copy.copy(self._acc)  # CUMULATIVE: a fresh object per yield
        snapshot.outputs = [_copy_completion(c) for c in self._acc.outputs]
        return snapshot

    def abort(self) -> None:
        """Abort the request in the engine unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)
        self._done = True

    async def aclose(self) -> None:
        self.abort()


# ---------------------------------------------------------------------------- engine thread
@dataclass
class _AddCommand:
    request_id: str
    prompt: Any
    params: SamplingParams
    arrival_time: float
    priority: int
    prompt_text: str | None
    future: asyncio.Future


@dataclass
class _CallCommand:
    fn: Callable[[Any], Any]
    future: asyncio.Future


@dataclass
class _Tracker:
    """Per-request timing, kept by the engine thread for metrics and the log line."""

    arrival_time: float
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)


_ABORT = "abort"
_STOP = "stop"


class AsyncLLMEngine:
    """Runs an ``LLMEngine`` in a background thread and serves it to asyncio code.

    Args:
        engine: a constructed ``LLMEngine`` (or anything with its API). From now on only
            the engine thread may touch it.
        max_waiting_requests: reject new requests beyond this many waiting (default
            ``engine.config.max_waiting_requests``; None = unbounded).
        metrics: an :class:`~pagedllm.metrics.EngineMetrics` to feed, or None.
        log_requests: log one line per finished request.
        stats_log_interval_s: seconds between status log lines (0 disables them).

    Use from a running event loop: :meth:`start` (or the first :meth:`add_request`)
    binds the engine to that loop. All public methods are event-loop-thread only.
    """

    def __init__(self, engine: Any, *, max_waiting_requests: int | None = None, metrics: Any = None,
                 log_requests: bool = True, stats_log_interval_s: float = 10.0) -> None:
        self.engine = engine
        config = getattr(engine, "config", None)
        if max_waiting_requests is None and config is not None:
            max_waiting_requests = getattr(config, "max_waiting_requests", None)
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.log_requests = log_requests
        self.stats_log_interval_s = stats_log_interval_s
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead_lock = threading.Lock()
        self._dead_error: BaseException | None = None
        self._is_stopped = False
        self._last_step_failed = False
        self._probe_task: asyncio.Task | None = None
        self._num_pending_adds = 0
        self._ids = itertools.count()
        # Engine-thread state.
        self._trackers: dict[str, _Tracker] = {}
        self.stats = engine.get_stats()  # the latest EngineStats snapshot (replaced, never mutated)
        self._last_log_time = time.monotonic()
        self._last_log_stats = self.stats

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> "AsyncLLMEngine":
        """Load an ``LLMEngine`` from an EngineConfig (blocking: loads the model) and wrap it."""
        from pagedllm.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config), **kwargs)

    # ------------------------------------------------------------------ engine facts
    @property
    def config(self) -> Any:
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        """The tokenizer. Decoding from the event loop is safe (read-only); encoding goes
        through :meth:`call` so the engine thread stays its only heavy user."""
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Start the engine thread bound to the running event loop (idempotent)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run_loop, name="pagedllm-engine", daemon=True)
        self._thread.start()
        if self.metrics is not None:
            self.metrics.set_healthy(True)
            self.metrics.record_stats(self.stats)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread after its current step; pending requests get EngineDeadError."""
        self._is_stopped = True
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join, timeout_s)
        self._fail_all(EngineDeadError("the engine has been shut down"))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead_error is None

    @property
    def is_healthy(self) -> bool:
        """True while the loop is alive and its last step did not fail every request in it."""
        return self._dead_error is None and not self._is_stopped and not self._last_step_failed

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    async def check_health(self, probe_timeout_s: float = 10.0) -> None:
        """Raise EngineDeadError if the loop died, EngineUnhealthyError if steps keep failing.

        When the last step failed all of its requests, this sends a one-token greedy probe
        request (shared by concurrent callers) and raises if it fails or times out.
        """
        self._raise_if_dead()
        if not self._last_step_failed:
            return
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.ensure_future(self._probe())
        try:
            error = await asyncio.wait_for(asyncio.shield(self._probe_task), probe_timeout_s)
        except asyncio.TimeoutError:
            raise EngineUnhealthyError(f"the health probe did not finish within {probe_timeout_s} s") from None
        if error is not None:
            raise EngineUnhealthyError(f"engine steps are failing: {error}")

    async def _probe(self) -> str | None:
        params = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)
        try:
            async for out in self.generate([0], params, f"health-probe-{next(self._ids)}"):
                if out.finished:
                    return out.error
        except EngineDeadError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure makes the probe fail
            return f"{type(e).__name__}: {e}"
        return None

    def _raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine loop has stopped: {type(self._dead_error).__name__}: "
                                  f"{self._dead_error}")
        if self._is_stopped:
            raise EngineDeadError("the engine has been shut down")

    # ------------------------------------------------------------------ requests
    def num_waiting_estimate(self) -> int:
        """Requests waiting in the scheduler (last snapshot) plus adds not yet applied."""
        return int(self.stats.num_waiting) + self._num_pending_adds

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams, *,
                          arrival_time: float | None = None, priority: int = 0,
                          prompt_text: str | None = None) -> RequestStream:
        """Queue a request and return its stream once the engine thread accepted it.

        ``prompt``: a string, token ids, or ``{"prompt_token_ids": [...]}`` (as
        ``LLMEngine.add_request``). Returns after validation, before any token is
        computed, so callers can answer a bad request before streaming anything.

        Raises:
            ValueError: the engine rejected the request (empty prompt, prompt +
                max_tokens beyond max_model_len, token id outside the vocabulary, ...).
            EngineOverloadedError: ``max_waiting_requests`` requests already wait.
            EngineDeadError: the engine loop has stopped.
        """
        self.start()
        self._raise_if_dead()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.max_waiting_requests is not None and self.num_waiting_estimate() >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"the server is overloaded: {self.num_waiting_estimate()} requests are waiting "
                f"(max_waiting_requests={self.max_waiting_requests}); retry later")
        user_kind = params.output_kind
        params = params.clone()
        params.output_kind = RequestOutputKind.DELTA
        stream = RequestStream(request_id, user_kind, self)
        future = self._loop.create_future()
        arrival = time.time() if arrival_time is None else arrival_time
        self._streams[request_id] = stream
        self._num_pending_adds += 1
        try:
            self._submit(_AddCommand(request_id, prompt, params, arrival, priority, prompt_text, future))
            await future
        except asyncio.CancelledError:
            # The add may still be applied: queue an abort behind it (commands are FIFO).
            self._streams.pop(request_id, None)
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finally:
            self._num_pending_adds -= 1
        return stream

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str | None = None, *,
                       arrival_time: float | None = None, priority: int = 0,
                       prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs (per ``params.output_kind``) until it finishes.

        Closing or cancelling the iterator before the end (client gone) aborts the
        request; its blocks are freed before the engine's next step. Raises as
        :meth:`add_request`, and EngineDeadError if the engine dies mid-request.
        """
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        stream = await self.add_request(request_id, prompt, params, arrival_time=arrival_time,
                                        priority=priority, prompt_text=prompt_text)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored). Safe from any coroutine."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.finished = True
        if self._dead_error is None and self._thread is not None:
            self._commands.put((_ABORT, request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread (between steps) and return its result.

        For tokenizer work (``engine.tokenize_prompt``, ``engine.apply_chat_template``)
        so the engine thread remains the only user of the engine. Exceptions of ``fn``
        propagate; raises EngineDeadError when the loop has stopped.
        """
        self.start()
        self._raise_if_dead()
        future = self._loop.create_future()
        self._submit(_CallCommand(fn, future))
        return await future

    def _submit(self, command: Any) -> None:
        with self._dead_lock:  # pairs with _on_dead: a command never lands in a dead queue
            self._raise_if_dead()
            self._commands.put(command)

    # ------------------------------------------------------------------ event-loop side
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)

    @staticmethod
    def _settle(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    # ------------------------------------------------------------------ engine thread
    def _run_loop(self) -> None:
        try:
            while True:
                if not self._apply_commands(block=not self.engine.has_unfinished_requests()):
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                self._refresh_stats()
        except BaseException as e:  # noqa: BLE001 - the loop must report any death
            self._on_dead(e)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one when idle. Returns False on stop."""
        commands = []
        if block:
            try:
                timeout = self.stats_log_interval_s if self.stats_log_interval_s > 0 else None
                commands.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                return True
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        aborts = []
        for cmd in commands:
            if cmd == _STOP:
                return False
            if isinstance(cmd, tuple) and cmd[0] == _ABORT:
                aborts.append(cmd[1])
            elif isinstance(cmd, _AddCommand):
                self._apply_add(cmd)
            elif isinstance(cmd, _CallCommand):
                self._apply_call(cmd)
        if aborts:
            self._apply_aborts(aborts)
        return True

    def _apply_add(self, cmd: _AddCommand) -> None:
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time,
                                    priority=cmd.priority, prompt_text=cmd.prompt_text)
        except Exception as e:  # noqa: BLE001 - a bad request must not kill the loop
            self._loop.call_soon_threadsafe(self._settle, cmd.future, None, e)
            return
        self._trackers[cmd.request_id] = _Tracker(cmd.arrival_time)
        self._loop.call_soon_threadsafe(self._settle, cmd.future, None, None)

    def _apply_call(self, cmd: _CallCommand) -> None:
        try:
            result = cmd.fn(self.engine)
        except Exception as e:  # noqa: BLE001
            self._loop.call_soon_threadsafe(self._settle, cmd.future, None, e)
            return
        self._loop.call_soon_threadsafe(self._settle, cmd.future, result, None)

    def _apply_aborts(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._trackers]
        if not live:
            return
        self.engine.abort_request(live)
        now = time.time()
        for rid in live:
            self._finish_tracker(rid, "abort", now, None)

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.time()
        if outputs:
            self._last_step_failed = all(o.error is not None for o in outputs)
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
            self._track(outputs, now)
        if self.metrics is not None:
            self.metrics.set_healthy(not self._last_step_failed)

    def _track(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            tr = self._trackers.get(out.request_id)
            if tr is None:
                continue
            tr.num_prompt_tokens = len(out.prompt_token_ids)
            tr.num_cached_tokens = out.num_cached_tokens
            num_new = sum(len(c.token_ids) for c in out.outputs)
            if num_new:
                if tr.first_token_time is None:
                    tr.first_token_time = now
                    if self.metrics is not None:
                        self.metrics.record_first_token(now - tr.arrival_time)
                elif self.metrics is not None:
                    self.metrics.record_inter_token(now - tr.last_token_time)
                tr.last_token_time = now
                tr.num_output_tokens += num_new
            for c in out.outputs:
                if c.finish_reason is not None:
                    tr.finish_reasons[c.index] = c.finish_reason
            if out.finished:
                reason = "error" if out.error is not None else tr.finish_reasons.get(0, "stop")
                first_scheduled = out.metrics.first_scheduled_time if out.metrics is not None else None
                self._finish_tracker(out.request_id, reason, now, first_scheduled)

    def _finish_tracker(self, request_id: str, reason: str, now: float, first_scheduled: float | None) -> None:
        tr = self._trackers.pop(request_id)
        e2e = now - tr.arrival_time
        ttft = None if tr.first_token_time is None else tr.first_token_time - tr.arrival_time
        if self.metrics is not None:
            queue_s = None if first_scheduled is None else first_scheduled - tr.arrival_time
            tpot = None
            if tr.num_output_tokens > 1 and tr.first_token_time is not None:
                tpot = (tr.last_token_time - tr.first_token_time) / (tr.num_output_tokens - 1)
            self.metrics.record_finished(reason, e2e, queue_s, tr.num_prompt_tokens, tr.num_output_tokens, tpot)
        if self.log_requests:
            logger.info("request %s finished: reason=%s prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
                        "ttft=%s total=%.3fs", request_id, reason, tr.num_prompt_tokens, tr.num_output_tokens,
                        tr.num_cached_tokens, "-" if ttft is None else f"{ttft:.3f}s", e2e)

    def _refresh_stats(self) -> None:
        self.stats = self.engine.get_stats()
        if self.metrics is not None:
            self.metrics.record_stats(self.stats)
        if self.stats_log_interval_s > 0 and time.monotonic() - self._last_log_time >= self.stats_log_interval_s:
            self._log_status()

    def _log_status(self) -> None:
        now = time.monotonic()
        s, prev = self.stats, self._last_log_stats
        dt = max(now - self._last_log_time, 1e-9)
        self._last_log_time, self._last_log_stats = now, s
        if s.num_steps == prev.num_steps and not s.num_running and not s.num_waiting:
            return  # idle: nothing new to say
        queries = s.prefix_cache_queries - prev.prefix_cache_queries
        hits = s.prefix_cache_hits - prev.prefix_cache_hits
        logger.info("engine: running=%d waiting=%d kv_usage=%.1f%% prefix_cache_hit_rate=%.1f%% "
                    "prompt_throughput=%.1f tok/s generation_throughput=%.1f tok/s preemptions=%d",
                    s.num_running, s.num_waiting, 100.0 * s.kv_cache_usage,
                    100.0 * hits / queries if queries else 0.0,
                    (s.prompt_tokens_total - prev.prompt_tokens_total) / dt,
                    (s.generation_tokens_total - prev.generation_tokens_total) / dt, s.num_preemptions_total)

    def _on_dead(self, error: BaseException) -> None:
        logger.error("engine loop died: %s: %s", type(error).__name__, error, exc_info=error)
        dead = EngineDeadError(f"the engine loop has stopped: {type(error).__name__}: {error}")
        with self._dead_lock:
            self._dead_error = error
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        if self.metrics is not None:
            self.metrics.set_healthy(False)
        loop = self._loop
        for cmd in pending:
            if isinstance(cmd, (_AddCommand, _CallCommand)):
                loop.call_soon_threadsafe(self._settle, cmd.future, None, dead)
        loop.call_soon_threadsafe(self._fail_all, dead)
