"""One data-parallel replica: an ``LLMEngine`` in its own process, and the proxy the server drives.

A process per replica gives each its own GIL and torch thread pool, and confines a crash to it.
:class:`ReplicaEngine` has ``LLMEngine``'s API, so an ordinary :class:`AsyncLLMEngine` drives
it. The pipe's messages and the failure model: docs/engine.md, "Data-parallel replicas".
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterable

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.errors import EngineDeadError

logger = logging.getLogger("pagedllm.data_parallel")

__all__ = ["ReplicaDeadError", "ReplicaEngine", "ReplicaInfo"]

EngineFactory = Callable[[EngineConfig], Any]


class ReplicaDeadError(EngineDeadError):
    """A data-parallel replica's process died, failed to start, or its loop failed."""


@dataclass
class ReplicaInfo:
    config: EngineConfig  # resolved (max_model_len set)
    model_name: str
    vocab_size: int
    stats: Any


def threads_per_replica(data_parallel_size: int, tensor_parallel_size: int = 1) -> int:
    """CPU threads each replica's torch uses: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // (data_parallel_size * tensor_parallel_size))


def _replica_main(index: int, config: EngineConfig, conn: Connection, engine_factory: EngineFactory | None,
                  num_threads: int, cuda_devices: str | None) -> None:
    """The replica process: build the engine, report ready, serve until ``stop`` or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server, which drains, then stops us
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # before torch is imported
        os.environ[var] = str(num_threads)
    # this replica's tensor-parallel ranks (processes it starts) share its threads, not the machine
    os.environ[envs.ENGINE_CORES.name] = str(num_threads * config.tensor_parallel_size)
    if cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    try:
        if engine_factory is None:
            import torch

            from pagedllm.engine.llm_engine import LLMEngine

            torch.set_num_threads(num_threads)
            engine_factory = LLMEngine
        engine = engine_factory(config)
        conn.send(("ready", ReplicaInfo(engine.config, engine.model_name, engine.vocab_size, engine.get_stats())))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the server
        conn.send(("start_failed", traceback.format_exc()))
        return
    try:
        _ReplicaLoop(engine, conn).run()
    except BaseException:  # noqa: BLE001 - the server fails this replica's requests with it
        logger.exception("data-parallel engine %d: loop died", index)
        try:
            conn.send(("dead", traceback.format_exc()))
        except (OSError, ValueError):
            pass
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            shutdown()


class _ReplicaLoop:
    def __init__(self, engine: Any, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn

    def run(self) -> None:
        while True:
            is_busy = self.engine.has_unfinished_requests()
            if not self._apply_commands(block=not is_busy):
                return
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                self.conn.send(("step", outputs, self.engine.get_stats()))
            else:
                self.conn.send(("stats", self.engine.get_stats()))

    def _apply_commands(self, block: bool) -> bool:
        """Apply every waiting command (at least one when ``block``); False on stop or server gone.
        After an ``add`` it waits for the next message (more adds of the same request, or ``go``),
        so a request's prompts are admitted in one turn."""
        try:
            if block or self.conn.poll():
                while True:
                    msg = self.conn.recv()
                    if not self._apply(msg):
                        return False
                    if msg[0] != "add" and not self.conn.poll():
                        return True
        except (EOFError, OSError):  # the server's end closed
            return False
        return True

    def _apply(self, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "stop":
            return False
        if kind == "abort":
            self.engine.abort_request(msg[1])
        elif kind == "add":
            _, call_id, request_id, prompt, params, arrival, priority, prompt_text = msg
            self._reply(call_id, lambda: self.engine.add_request(request_id, prompt, params, arrival_time=arrival,
                                                                 priority=priority, prompt_text=prompt_text))
        elif kind == "call":
            _, call_id, method, args = msg
            self._reply(call_id, lambda: getattr(self.engine, method)(*args))
        return True

    def _reply(self, call_id: int, fn: Callable[[], Any]) -> None:
        try:
            result = ("reply", call_id, True, fn())
        except Exception as e:  # noqa: BLE001 - the caller gets the exception
            result = ("reply", call_id, False, e)
        try:
            self.conn.send(result)
        except Exception as e:  # noqa: BLE001 - a result or exception that does not pickle
            self.conn.send(("reply", call_id, False, RuntimeError(f"{type(result[3]).__name__}: {result[3]} "
                                                                  f"(not sendable: {e})")))


class ReplicaEngine:
    """Server-side proxy of replica ``index``: ``LLMEngine``'s API over a pipe to its process.

    The process starts at construction (``engine_factory`` must pickle); :meth:`wait_ready` waits
    for its engine. ``on_exit`` / ``on_stats`` run on the reader thread (pipe closed; stats outside
    a step). One thread at a time may call ``add_request`` / ``step`` / ``get_stats`` /
    ``kv_cache_snapshot``; ``abort_request``, ``is_alive`` and ``shutdown`` from any thread.
    """

    def __init__(self, index: int, config: EngineConfig, tokenizer: Any = None, *,
                 engine_factory: EngineFactory | None = None, num_threads: int = 1,
                 cuda_devices: str | None = None, on_exit: Callable[[int], None] | None = None,
                 on_stats: Callable[[int], None] | None = None) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.on_exit = on_exit
        self.on_stats = on_stats
        ctx = mp.get_context("spawn")  # never fork a process that holds torch threads
        self._conn, child = ctx.Pipe()
        # not a daemon: a tensor-parallel replica starts processes of its own
        self.process = ctx.Process(target=_replica_main, name=f"pagedllm-dp-engine{index}", daemon=False,
                                   args=(index, config, child, engine_factory, num_threads, cuda_devices))
        self.process.start()
        child.close()
        self._send_lock = threading.Lock()
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._steps: deque[tuple] = deque()  # step messages read while waiting for a reply
        self._replies: dict[int, tuple] = {}
        self._call_ids = itertools.count()
        self._unfinished: set[str] = set()
        self._is_holding = False  # the last message sent was an add
        self._exit_reason: str | None = None
        self._is_shut_down = False
        self.info: ReplicaInfo | None = None
        self.config = config
        self.model_name = config.model
        self.vocab_size = 0
        self._stats: Any = None
        atexit.register(self.shutdown)  # before multiprocessing's own exit hook joins the process

    def wait_ready(self, timeout_s: float | None = None) -> ReplicaInfo:
        """Wait for the replica's engine; ReplicaDeadError when it failed to start (with its
        traceback), died, or took longer than ``timeout_s``."""
        ready = wait([self._conn, self.process.sentinel], timeout=timeout_s)
        if self._conn in ready:
            try:
                kind, detail = self._conn.recv()
            except (EOFError, OSError):
                kind, detail = "start_failed", "its pipe closed"
            if kind == "ready":
                self._on_ready(detail)
                return detail
            self.shutdown()
            raise ReplicaDeadError(f"data-parallel engine {self.index} failed to start: {detail}")
        self.process.join(timeout=1.0)
        reason = self._describe_exit() if not self.process.is_alive() else f"not ready within {timeout_s:g} s"
        self.shutdown()
        raise ReplicaDeadError(f"data-parallel engine {self.index} failed to start: {reason}")

    def _on_ready(self, info: ReplicaInfo) -> None:
        self.info = info
        self.config, self.model_name, self.vocab_size, self._stats = (info.config, info.model_name,
                                                                      info.vocab_size, info.stats)
        threading.Thread(target=self._read, name=f"pagedllm-dp-reader{self.index}", daemon=True).start()

    def _read(self) -> None:
        """Reader thread: messages into the inbox, then ``("gone",)``."""
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "dead":
                self._exit_reason = f"data-parallel engine {self.index} (pid {self.process.pid}) failed: {msg[1]}"
                break
            if kind == "stats":  # newest first-hand: taken here, in arrival order, never queued
                self._stats = msg[1]
                if self.on_stats is not None:
                    self.on_stats(self.index)
                continue
            if kind == "step":
                self._stats = msg[2]
            self._inbox.put(msg)
        self.process.join(timeout=5.0)
        if self._exit_reason is None:
            self._exit_reason = self._describe_exit()
        self._inbox.put(("gone",))
        if self.on_exit is not None and not self._is_shut_down:
            self.on_exit(self.index)

    def add_request(self, request_id: str, prompt: Any, params: Any, arrival_time: float | None = None,
                    priority: int = 0, prompt_text: str | None = None) -> str:
        """Round trip; raises what the replica's ``add_request`` raised, or ReplicaDeadError."""
        self._call(("add", None, request_id, prompt, params, arrival_time, priority, prompt_text))
        self._unfinished.add(request_id)
        self._is_holding = True
        return request_id

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._unfinished.difference_update(ids)
        self._send(("abort", ids), quiet=True)

    def step(self) -> list:
        """The replica's next step's outputs (blocking); ReplicaDeadError once it is gone."""
        if self._is_holding:
            self._is_holding = False
            self._send(("go",))
        outputs = (self._steps.popleft() if self._steps else self._next_step())[1]
        for out in outputs:
            if out.finished:
                self._unfinished.discard(out.request_id)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def get_stats(self) -> Any:
        """The latest stats the replica sent (never blocks); ReplicaDeadError once it is gone."""
        if self._exit_reason is not None:
            raise ReplicaDeadError(self._exit_reason)
        return self._stats

    def kv_cache_snapshot(self) -> Any:
        return self.call_engine("kv_cache_snapshot")

    def call_engine(self, method: str, *args: Any) -> Any:
        """``engine.<method>(*args)`` in the replica between two steps: its result or exception."""
        return self._call(("call", None, method, args))

    def is_alive(self) -> bool:
        return self._exit_reason is None and self.process.is_alive()

    @property
    def exit_reason(self) -> str | None:
        if self._exit_reason is None and not self.process.is_alive():
            self._exit_reason = self._describe_exit()
        return self._exit_reason

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the replica (a polite ``stop``, then terminate, then kill). Idempotent."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        atexit.unregister(self.shutdown)
        self._send(("stop",), quiet=True)
        self.process.join(timeout=timeout_s)
        for end in (self.process.terminate, self.process.kill):
            if not self.process.is_alive():
                break
            end()
            self.process.join(timeout=5.0)
        if self._exit_reason is None:
            self._exit_reason = f"data-parallel engine {self.index} has been shut down"
        self._conn.close()

    def _call(self, msg: tuple) -> Any:
        call_id = next(self._call_ids)
        self._send((msg[0], call_id, *msg[2:]))
        while call_id not in self._replies:
            self._take(self._inbox.get())
        _, _, is_ok, value = self._replies.pop(call_id)
        if not is_ok:
            raise value
        return value

    def _next_step(self) -> tuple:
        while not self._steps:
            self._take(self._inbox.get())
        return self._steps.popleft()

    def _take(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "step":
            self._steps.append(msg)
        elif kind == "reply":
            self._replies[msg[1]] = msg
        else:  # "gone": stays in the inbox so every later wait raises too
            self._inbox.put(msg)
            raise ReplicaDeadError(self._exit_reason or self._describe_exit())

    def _send(self, msg: tuple, quiet: bool = False) -> None:
        """Raises ReplicaDeadError (``quiet``: nothing) when the replica is gone."""
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError):
            if not quiet:
                self.process.join(timeout=1.0)
                raise ReplicaDeadError(self.exit_reason or self._describe_exit()) from None

    def _describe_exit(self) -> str:
        code = self.process.exitcode
        if code is None:
            how = "its pipe closed"
        elif code < 0:
            how = f"killed by signal {-code}" + (f" ({signal.Signals(-code).name})" if -code in
                                                  signal.valid_signals() else "")
        else:
            how = f"exit code {code}"
        return f"data-parallel engine {self.index} (pid {self.process.pid}) died ({how})"
