"""Data parallelism for the server: N engine replicas behind one OpenAI front end.

:class:`DataParallelAsyncEngine` has ``AsyncLLMEngine``'s API over N replica processes
(:mod:`pagedllm.engine.replica`), so the HTTP layer is the same for one engine or N. Why and
the failure model: docs/architecture.md, "Data parallelism".
"""

from __future__ import annotations

import asyncio
import logging
import itertools
import os
import time
from typing import Any, Callable

from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineInput
from pagedllm.errors import EngineDeadError, EngineUnhealthyError
from pagedllm.engine.front_end import FrontEnd, FrontEndThread, tokenize_inputs
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.replica import EngineFactory, ReplicaEngine, ReplicaInfo, threads_per_replica
from pagedllm.engine.request_stream import RequestStream
from pagedllm.engine.router import ReplicaLoad, Router, make_router
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.data_parallel")

__all__ = ["DataParallelAsyncEngine", "FrontEnd"]


class DataParallelAsyncEngine:
    """``AsyncLLMEngine``'s API over N replicas (build it with :meth:`from_config`), event-loop
    thread only. ``metrics`` are replica 0's (:meth:`EngineMetrics.for_engine` gives the others)."""

    def __init__(self, replicas: list[AsyncLLMEngine], front: Any, config: EngineConfig, router: Router,
                 metrics: Any = None) -> None:
        self.replicas = replicas
        self.front = front
        self.config = config
        self.router = router
        self.metrics = metrics
        self._front_thread = FrontEndThread(front)
        self._in_flight: list[dict[str, int]] = [{} for _ in replicas]  # request id -> tokens, per replica
        self._routed: list[dict[int, tuple[int, int]]] = [{} for _ in replicas]  # routed, not yet accepted
        self._route_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_stopped = False

    @classmethod
    def from_config(cls, config: EngineConfig, *, metrics: Any = None, log_requests: bool = True,
                    stats_log_interval_s: float = 10.0, engine_factory: EngineFactory | None = None,
                    front: Any = None, start_timeout_s: float | None = None) -> "DataParallelAsyncEngine":
        """Start the replica processes and wait for their engines (blocking). Raises ValueError
        for too few GPUs, ReplicaDeadError when a replica fails to start (the others stopped)."""
        n = config.data_parallel_size
        if engine_factory is None:
            _check_generate_replicas(config)
        replica_config = config.replace(data_parallel_size=1)
        devices = _cuda_device_slices(config)
        threads = threads_per_replica(n, config.tensor_parallel_size)
        proxies: list[ReplicaEngine] = []
        try:
            for i in range(n):
                proxies.append(ReplicaEngine(i, replica_config, engine_factory=engine_factory, num_threads=threads,
                                             cuda_devices=devices[i]))
            files = None
            if front is None:  # while the replicas load their weights
                from pagedllm.loader import load_model_files

                files = load_model_files(config.model, config.tokenizer)
            infos = [p.wait_ready(start_timeout_s) for p in proxies]
        except BaseException:
            for p in proxies:
                p.shutdown()
            raise
        front = front if front is not None else FrontEnd(InputProcessor(
            files.tokenizer, infos[0].vocab_size, infos[0].config.max_model_len, infos[0].config.max_logprobs, [],
            infos[0].config.chat_template_timeout_s))
        replicas = []
        for i, proxy in enumerate(proxies):
            proxy.tokenizer = front.tokenizer
            replicas.append(AsyncLLMEngine(proxy, metrics=None if metrics is None else metrics.for_engine(i),
                                           log_requests=log_requests, stats_log_interval_s=stats_log_interval_s,
                                           name=f"engine {i}"))
        served = config.replace(max_model_len=infos[0].config.max_model_len)
        engine = cls(replicas, front, served, make_router(config.data_parallel_router, config.block_size), metrics)
        for proxy in proxies:
            proxy.on_exit, proxy.on_stats = engine._on_replica_exit, engine._on_replica_stats
        logger.info("data parallel: %d replicas (pids %s), %d CPU threads each, router %s", n,
                    [p.process.pid for p in proxies], threads, config.data_parallel_router)
        return engine

    @property
    def tokenizer(self) -> Any:
        return self.front.tokenizer

    @property
    def model_name(self) -> str:
        return self.replicas[0].model_name

    @property
    def vocab_size(self) -> int:
        return self.replicas[0].vocab_size

    @property
    def num_active_streams(self) -> int:
        return sum(r.num_active_streams for r in self.replicas)

    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        for replica in self.replicas:
            replica.start()

    async def shutdown(self, timeout_s: float = 30.0, reason: str = "the engine has been shut down") -> None:
        """Stop every replica (thread, then process); open streams raise EngineDeadError(``reason``)."""
        self._is_stopped = True
        await asyncio.gather(*(r.shutdown(timeout_s, reason) for r in self.replicas))
        self._front_thread.shutdown()

    @property
    def is_running(self) -> bool:
        return any(r.is_running for r in self.replicas)

    @property
    def is_healthy(self) -> bool:
        return not self._is_stopped and all(self._down_reason(i) is None and r.is_healthy
                                            for i, r in enumerate(self.replicas))

    @property
    def dead_error(self) -> BaseException | None:
        """Set only when no replica can serve any more."""
        if any(self._down_reason(i) is None for i in range(len(self.replicas))):
            return None
        return EngineDeadError("; ".join(self._down_reasons()))

    async def check_health(self, probe_timeout_s: float = 10.0) -> None:
        """EngineDeadError when no replica serves, EngineUnhealthyError naming each replica down or failing."""
        if self._is_stopped:
            raise EngineDeadError("the engine has been shut down")
        problems = self._down_reasons()
        for i, replica in enumerate(self.replicas):
            if self._down_reason(i) is not None:
                continue
            try:
                await replica.check_health(probe_timeout_s)
            except (EngineDeadError, EngineUnhealthyError) as e:
                problems.append(f"data-parallel engine {i}: {e}")
        if not problems:
            return
        message = f"{len(problems)} of {len(self.replicas)} data-parallel engines unhealthy: " + "; ".join(problems)
        if len(problems) == len(self.replicas):
            raise EngineDeadError(message)
        raise EngineUnhealthyError(message)

    def _down_reason(self, index: int) -> str | None:
        """Why replica ``index`` cannot serve, or None."""
        proxy: ReplicaEngine = self.replicas[index].engine
        return None if proxy.is_alive() else proxy.exit_reason

    def _down_reasons(self) -> list[str]:
        return [r for r in (self._down_reason(i) for i in range(len(self.replicas))) if r is not None]

    def _on_replica_exit(self, index: int) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop_replica, index)

    def _on_replica_stats(self, index: int) -> None:
        """Fresh stats outside a step: wake an idle engine thread (it waits for a command) to record them."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake_idle, index)

    def _wake_idle(self, index: int) -> None:
        replica = self.replicas[index]
        if replica.is_running and not replica.engine.has_unfinished_requests():
            asyncio.ensure_future(_quietly(replica.call(lambda proxy: None)))

    def _stop_replica(self, index: int) -> None:
        reason = self._down_reason(index) or f"data-parallel engine {index} stopped"
        logger.error("%s; its requests fail, the other replicas keep serving", reason)
        forget = getattr(self.router, "forget", None)
        if forget is not None:
            forget(index)
        replica = self.replicas[index]
        if replica.metrics is not None:
            replica.metrics.set_healthy(False)
        asyncio.ensure_future(replica.shutdown(reason=reason))

    def _raise_if_dead(self) -> None:
        if self._is_stopped:
            raise EngineDeadError("the engine has been shut down")
        error = self.dead_error
        if error is not None:
            raise error

    async def add_requests(self, label: str, inputs: list[EngineInput], params: SamplingParams, *,
                           arrival_time: float | None = None, priority: int = 0) -> list[RequestStream]:
        """Tokenize the prompts and add them all to the one replica the router picks. Raises as
        :meth:`AsyncLLMEngine.add_requests` (EngineDeadError also when no replica serves)."""
        self.start()
        self._raise_if_dead()
        arrival = time.time() if arrival_time is None else arrival_time
        tokenized = await self.call(lambda front: tokenize_inputs(front, inputs))
        index = self.router.route(tokenized[0].prompt["prompt_token_ids"], self._loads())
        tokens = sum(len(t.prompt["prompt_token_ids"]) for t in tokenized) + params.n * (params.max_tokens or 0)
        route_id = next(self._route_ids)  # the replica's load counts it from now, not once it accepts
        self._routed[index][route_id] = (len(tokenized), tokens)
        try:
            streams = await self.replicas[index].add_requests(label, tokenized, params, arrival_time=arrival,
                                                              priority=priority)
        finally:
            del self._routed[index][route_id]
        for stream in streams:
            self._in_flight[index][stream.request_id] = tokens // len(streams)
        return streams

    # the single engine's methods: they only call add_requests / add_request on self
    add_request = AsyncLLMEngine.add_request
    generate = AsyncLLMEngine.generate

    def _loads(self) -> list[ReplicaLoad | None]:
        """Each replica's requests and tokens in flight; None for a replica that cannot serve."""
        loads: list[ReplicaLoad | None] = []
        for i, replica in enumerate(self.replicas):
            if self._down_reason(i) is not None or not replica.is_running:
                loads.append(None)
                continue
            live = self._in_flight[i]
            for rid in [rid for rid in live if not replica.is_active(rid)]:
                del live[rid]
            routed = self._routed[i].values()
            loads.append(ReplicaLoad(len(live) + sum(n for n, _ in routed),
                                     sum(live.values()) + sum(t for _, t in routed)))
        if all(load is None for load in loads):
            raise EngineDeadError("no data-parallel engine can serve: " + "; ".join(self._down_reasons()))
        return loads

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(front)`` on the front end's thread; EngineDeadError once shut down."""
        self.start()
        if self._is_stopped:
            raise EngineDeadError("the engine has been shut down")
        return await self._front_thread.call(fn)

    call_front = call

    async def kv_cache_snapshot(self, engine_index: int = 0) -> Any:
        """Replica ``engine_index``'s KV-cache snapshot; ValueError outside 0..N-1."""
        if not 0 <= engine_index < len(self.replicas):
            raise ValueError(f"engine must be in 0..{len(self.replicas) - 1}, got {engine_index}")
        return await self.replicas[engine_index].call(lambda proxy: proxy.kv_cache_snapshot())


async def _quietly(awaitable: Any) -> None:
    try:
        await awaitable
    except EngineDeadError:
        pass


def _cuda_device_slices(config: EngineConfig) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` per replica (i gets visible GPUs ``i*tp .. (i+1)*tp - 1``; None:
    all). Raises ValueError naming data_parallel_size for too few GPUs."""
    n, tp = config.data_parallel_size, config.tensor_parallel_size
    if config.device == "cpu":
        return [None] * n
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return [None] * n
    if count < n * tp:
        raise ValueError(f"data_parallel_size={n} x tensor_parallel_size={tp} needs {n * tp} GPUs, found {count}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(count)]
    return [",".join(ids[i * tp:(i + 1) * tp]) for i in range(n)]


def _check_generate_replicas(config: EngineConfig) -> None:
    """Replicas are generation engines: a pooling model is a ValueError naming data_parallel_size and the
    runner, before any process starts."""
    from pagedllm.engine.pooling_engine import select_runner

    if select_runner(config) == "pooling":
        raise ValueError(f"data_parallel_size={config.data_parallel_size}: {config.model!r} runs with runner='pooling', "
                         "which serves one replica; leave data_parallel_size at 1 (larger batches: max_num_batched_tokens, "
                         "max_num_seqs)")
