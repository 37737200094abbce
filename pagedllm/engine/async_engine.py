"""AsyncLLMEngine: the synchronous :class:`LLMEngine` run by one background thread and served
to asyncio code through a command queue and per-request streams (why: docs/architecture.md,
"The async engine")."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Protocol, Union

from pagedllm.config import EngineConfig
from pagedllm.errors import EngineDeadError, EngineOverloadedError, EngineUnhealthyError
from pagedllm.engine.front_end import FrontEndThread, needs_tokenizing, tokenize_inputs
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.request_stream import RequestStream, merge_request_output
from pagedllm.engine.request_tracker import RequestTracker, StatusLogger
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import EngineStats
    from pagedllm.metrics import EngineMetrics

logger = logging.getLogger("pagedllm.async_engine")

__all__ = ["AsyncLLMEngine", "EngineInput", "RequestStream", "EngineDeadError", "EngineOverloadedError",
           "EngineUnhealthyError", "merge_request_output"]


class SyncEngine(Protocol):
    """What the async front needs of the engine it drives (``LLMEngine`` or a test fake)."""

    config: EngineConfig
    tokenizer: Any
    model_name: str
    vocab_size: int

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float,
                    priority: int, prompt_text: str | None) -> str: ...

    def abort_request(self, request_ids: Iterable[str]) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def get_stats(self) -> "EngineStats": ...


@dataclass(frozen=True)
class EngineInput:
    """One prompt of a request: a string, token ids, or ``{"prompt_token_ids": [...]}``,
    and the prompt text to report (None: the prompt itself when it is a string)."""

    prompt: PromptType
    prompt_text: str | None = None


@dataclass
class _AddCommand:
    """Add every prompt of one request, or none of them."""

    request_ids: list[str]
    labels: list[str]
    inputs: list[EngineInput]
    params: SamplingParams
    arrival_time: float
    priority: int
    future: asyncio.Future


@dataclass
class _AbortCommand:
    request_id: str


@dataclass
class _CallCommand:
    fn: Callable[[Any], Any]
    future: asyncio.Future


@dataclass
class _StopCommand:
    pass


Command = Union[_AddCommand, _AbortCommand, _CallCommand, _StopCommand]


class AsyncLLMEngine:
    """Runs an ``LLMEngine`` in a background thread and serves it to asyncio code.

    Only the engine thread touches ``engine``; ``front`` (default ``engine.front_end()``; none: the
    engine thread) does tokenizer work. A caller's request id is a *label*; engine requests get
    ``f"{label}-{k}"``, unique whatever callers send. :meth:`start` binds the engine to the
    running event loop; public methods are for that loop's thread only.
    """

    def __init__(self, engine: SyncEngine, *, max_waiting_requests: int | None = None,
                 metrics: "EngineMetrics | None" = None, log_requests: bool = True,
                 stats_log_interval_s: float = 10.0, name: str = "engine", front: Any = None) -> None:
        self.engine = engine
        if front is None and hasattr(engine, "front_end"):
            front = engine.front_end()
        self._front_thread = FrontEndThread(front) if front is not None else None
        if max_waiting_requests is None:
            max_waiting_requests = engine.config.max_waiting_requests
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.stats_log_interval_s = stats_log_interval_s
        self._commands: queue.Queue[Command] = queue.Queue()
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
        self._tracker = RequestTracker(metrics, log_requests)
        self.stats = engine.get_stats()  # the latest EngineStats snapshot (replaced, never mutated)
        self._status_logger = StatusLogger(stats_log_interval_s, self.stats, name)

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> "AsyncLLMEngine":
        """Wrap a new ``LLMEngine`` (blocking: loads the model)."""
        from pagedllm.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config), **kwargs)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        """Safe to decode with from the event loop (read-only); encode through :meth:`call_front`."""
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def num_active_streams(self) -> int:
        """Requests accepted and not yet finished or aborted."""
        return len(self._streams)

    def is_active(self, request_id: str) -> bool:
        """Whether internal id ``request_id`` is accepted and not finished, aborted or failed."""
        return request_id in self._streams

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

    async def shutdown(self, timeout_s: float = 30.0, reason: str = "the engine has been shut down") -> None:
        """Stop the engine thread after its step, then ``engine.shutdown()``; open streams and later
        requests raise EngineDeadError(``reason``). Idempotent."""
        self._is_stopped = True
        if self._front_thread is not None:
            self._front_thread.shutdown()
        if self._thread is None:
            await asyncio.to_thread(self._shutdown_engine)  # never started: nothing else will
            return
        self._commands.put(_StopCommand())
        await asyncio.to_thread(self._thread.join, timeout_s)
        self._fail_all(EngineDeadError(reason))

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
        """Raise EngineDeadError if the loop died; after a step that failed all its requests, send a
        one-token probe (shared by concurrent callers) and raise EngineUnhealthyError if it fails."""
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
            async for out in self.generate([0], params, "health-probe"):
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

    def num_waiting_estimate(self) -> int:
        """Requests waiting in the scheduler (last snapshot) plus adds not yet applied."""
        return int(self.stats.num_waiting) + self._num_pending_adds

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                          arrival_time: float | None = None, priority: int = 0,
                          prompt_text: str | None = None) -> RequestStream:
        """:meth:`add_requests` with one prompt."""
        (stream,) = await self.add_requests(request_id, [EngineInput(prompt, prompt_text)], params,
                                            arrival_time=arrival_time, priority=priority)
        return stream

    async def add_requests(self, label: str, inputs: list[EngineInput], params: SamplingParams, *,
                           arrival_time: float | None = None, priority: int = 0) -> list[RequestStream]:
        """Queue one engine request per prompt in one turn; return their streams once the engine
        accepted all (or none), before any token is computed. Cancelling aborts every prompt.
        Raises ValueError for a rejected prompt (``prompt[i]:`` for i > 0; nothing stays queued),
        EngineOverloadedError past ``max_waiting_requests``, EngineDeadError after the loop stopped."""
        self.start()
        self._raise_if_dead()
        if self.max_waiting_requests is not None and self.num_waiting_estimate() >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"the server is overloaded: {self.num_waiting_estimate()} requests are waiting "
                f"(max_waiting_requests={self.max_waiting_requests}); retry later")
        self._num_pending_adds += len(inputs)  # counted from arrival, through tokenization
        try:
            return await self._tokenize_and_add(label, inputs, params, arrival_time, priority)
        finally:
            self._num_pending_adds -= len(inputs)

    async def _tokenize_and_add(self, label: str, inputs: list[EngineInput], params: SamplingParams,
                                arrival_time: float | None, priority: int) -> list[RequestStream]:
        if self._front_thread is not None and any(needs_tokenizing(item.prompt) for item in inputs):
            inputs = await self.call_front(lambda front: tokenize_inputs(front, inputs))
        user_kind = params.output_kind
        params = params.clone()
        params.output_kind = RequestOutputKind.DELTA
        labels = [label] if len(inputs) == 1 else [f"{label}[{i}]" for i in range(len(inputs))]
        ids = [f"{label}-{next(self._ids)}" for _ in inputs]
        streams = [RequestStream(rid, lbl, user_kind, self.abort) for rid, lbl in zip(ids, labels)]
        future = self._loop.create_future()
        arrival = time.time() if arrival_time is None else arrival_time
        self._streams.update(zip(ids, streams))
        try:
            self._submit(_AddCommand(ids, labels, inputs, params, arrival, priority, future))
            await future
        except asyncio.CancelledError:
            for rid in ids:  # the add may still be applied: queue aborts behind it (commands are FIFO)
                self.abort(rid)
            raise
        except BaseException:
            for rid in ids:
                self._streams.pop(rid, None)
            raise
        return streams

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None, *,
                       arrival_time: float | None = None, priority: int = 0,
                       prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield a request's outputs (per ``params.output_kind``) until it finishes. Closing the
        iterator early aborts it (blocks freed before the next step). Raises as
        :meth:`add_requests`, and EngineDeadError if the engine dies mid-request."""
        stream = await self.add_request(request_id or "req", prompt, params, arrival_time=arrival_time,
                                        priority=priority, prompt_text=prompt_text)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort an engine request by its internal id (unknown or finished ids are ignored)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.finished = True
        if self._dead_error is None and self._thread is not None:
            self._commands.put(_AbortCommand(request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine)`` on the engine thread between steps; its exceptions propagate, and
        EngineDeadError after the loop stopped."""
        self.start()
        self._raise_if_dead()
        future = self._loop.create_future()
        self._submit(_CallCommand(fn, future))
        return await future

    async def call_front(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(front)`` on the front-end thread (tokenizer work never delays a step or the loop);
        without a front end :meth:`call`. Raises as :meth:`call`."""
        if self._front_thread is None:
            return await self.call(fn)
        self._raise_if_dead()
        if self._is_stopped:
            raise EngineDeadError("the engine has been shut down")
        return await self._front_thread.call(fn)

    async def kv_cache_snapshot(self, engine_index: int = 0):
        """The engine's KVCacheSnapshot between two steps. Raises ValueError for an ``engine_index``
        other than 0, AttributeError without a KV cache, EngineDeadError after the loop stopped."""
        if engine_index != 0:
            raise ValueError(f"engine must be 0 (this server runs one engine), got {engine_index}")
        return await self.call(lambda e: e.kv_cache_snapshot())

    def _submit(self, command: Command) -> None:
        with self._dead_lock:  # pairs with _on_dead: a command never lands in a dead queue
            self._raise_if_dead()
            self._commands.put(command)

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

    def _reply(self, future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
        self._loop.call_soon_threadsafe(self._settle, future, result, error)

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
        finally:
            self._shutdown_engine()  # stopped or dead, this thread was the engine's last user

    def _shutdown_engine(self) -> None:
        """``engine.shutdown()`` if it has one; a failure is logged, never raised."""
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is None:
            return
        try:
            shutdown()
        except Exception as e:  # noqa: BLE001
            logger.warning("engine shutdown failed: %s: %s", type(e).__name__, e)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one when idle. Returns False on stop."""
        commands: list[Command] = []
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
            if isinstance(cmd, _StopCommand):
                return False
            if isinstance(cmd, _AbortCommand):
                aborts.append(cmd.request_id)
            elif isinstance(cmd, _AddCommand):
                self._apply_add(cmd)
            else:
                self._apply_call(cmd)
        if aborts:
            self._apply_aborts(aborts)
        return True

    def _apply_add(self, cmd: _AddCommand) -> None:
        added: list[str] = []
        for i, (rid, item) in enumerate(zip(cmd.request_ids, cmd.inputs)):
            try:
                self.engine.add_request(rid, item.prompt, cmd.params, arrival_time=cmd.arrival_time,
                                        priority=cmd.priority, prompt_text=item.prompt_text)
            except Exception as e:  # noqa: BLE001 - a bad request must not kill the loop
                if added:
                    self.engine.abort_request(added)
                if i > 0 and isinstance(e, ValueError):
                    e = ValueError(f"prompt[{i}]: {e}")
                self._reply(cmd.future, None, e)
                return
            added.append(rid)
        for rid, label in zip(added, cmd.labels):
            self._tracker.start(rid, label, cmd.arrival_time)
        self.stats = self.engine.get_stats()  # counts them before their pending add is released
        self._reply(cmd.future)

    def _apply_call(self, cmd: _CallCommand) -> None:
        try:
            result = cmd.fn(self.engine)
        except Exception as e:  # noqa: BLE001
            self._reply(cmd.future, None, e)
            return
        self._reply(cmd.future, result)

    def _apply_aborts(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._tracker]
        if not live:
            return
        self.engine.abort_request(live)
        self._tracker.abort(live, time.time())

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.time()
        if outputs:
            self._last_step_failed = all(o.error is not None for o in outputs)
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
            self._tracker.observe(outputs, now)
        if self.metrics is not None:
            self.metrics.set_healthy(not self._last_step_failed)

    def _refresh_stats(self) -> None:
        self.stats = self.engine.get_stats()
        if self.metrics is not None:
            self.metrics.record_stats(self.stats)
        self._status_logger.maybe_log(self.stats)

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
        for cmd in pending:
            if isinstance(cmd, (_AddCommand, _CallCommand)):
                self._reply(cmd.future, None, dead)
        self._loop.call_soon_threadsafe(self._fail_all, dead)
