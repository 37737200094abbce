"""Executors: who runs the model runner, on how many ranks.

:class:`UniprocExecutor` — one runner in the engine process (``tensor_parallel_size=1``).

``tensor_parallel_size=N``: the engine process is rank 0 (its runner is the *driver*, whose
outputs the engine uses) and ranks 1..N-1 are workers (:mod:`~pagedllm.distributed.worker`),
each building its own runner over its shard of the weights and its own KV pool. The scheduler
and KV-cache manager run once, in the engine; every call (``initialize_kv_cache``,
``initialize_kv_offload``, ``initialize_swap_space``, ``execute_model(SchedulerOutput)``,
``reset_state``, ``collective_rpc``) goes to every worker and runs on all ranks in lock step,
because the model's collectives (all-reduce, all-gather) need every rank. Workers sample too
(the same seeds and the same full logits), so their per-request token copies stay the same
as the driver's; only the driver's output is returned. Two transports:

- :class:`MultiprocExecutor` (``distributed_executor_backend="mp"``): worker processes on
  this machine (``spawn``), calls over pipes;
- :class:`~pagedllm.distributed.ray_executor.RayExecutor` (``"ray"``): Ray actors placed by a
  placement group, so ranks can span the machines of a Ray cluster.

A failure on any rank is fatal, as in vLLM: after it the ranks are out of lock step. A worker
that dies (killed, out of memory) or raises, or a call that raises on rank 0, fails the
executor: the call in flight and every later one raise :class:`TensorParallelWorkerError`
naming the rank and the cause. The failing rank leaves the process group, which makes its
peers' pending collectives fail at once (gloo reports the closed connection), and every wait
on a worker is bounded by ``worker_timeout_s``, so nothing hangs.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from pagedllm.config import EngineConfig
from pagedllm.distributed.worker import TensorParallelWorker, run_on_runner
from pagedllm.engine.errors import EngineDeadError

logger = logging.getLogger("pagedllm")
# After rank 0 failed: how long to wait for the workers' own reports before stopping them.
_REPORT_WAIT_S = 30.0


class TensorParallelWorkerError(EngineDeadError):
    """A tensor-parallel rank died or failed; the engine cannot run another step."""


class UniprocExecutor:
    """The runner in this process (``tensor_parallel_size=1``)."""

    world_size = 1

    def __init__(self, config: EngineConfig, model_files) -> None:
        from pagedllm.worker.model_runner import ModelRunner

        self.driver = ModelRunner(config, model_files)

    def initialize_kv_cache(self):
        return self.driver.initialize_kv_cache()

    def initialize_kv_offload(self):
        return self.driver.initialize_kv_offload()

    def initialize_swap_space(self):
        return self.driver.initialize_swap_space()

    def execute_model(self, scheduler_output, grammar_bitmask=None):
        if grammar_bitmask is None:  # the common case; keeps the runner's one-argument form
            return self.driver.execute_model(scheduler_output)
        return self.driver.execute_model(scheduler_output, grammar_bitmask)

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list:
        """``[runner.method(*args, **kwargs)]`` (or ``method(runner, ...)`` for a callable)."""
        return [run_on_runner(self.driver, method, args, kwargs)]

    def reset_state(self) -> None:
        self.driver.reset_state()

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig, model_files):
    """The executor ``config.tensor_parallel_size`` and ``distributed_executor_backend`` ask for."""
    if config.tensor_parallel_size == 1:
        return UniprocExecutor(config, model_files)
    if config.distributed_executor_backend == "ray":
        from pagedllm.distributed.ray_executor import RayExecutor

        return RayExecutor(config, model_files)
    return MultiprocExecutor(config, model_files)


class DistributedExecutor:
    """Rank 0 (the driver) in this process plus workers elsewhere; subclasses move the calls.

    A subclass sets ``world_size``, ``timeout_s`` and ``driver`` and implements
    :meth:`_send` (the call to every worker) and :meth:`_gather` (every worker's reply).
    """

    world_size: int
    timeout_s: float
    driver: Any
    _error: str | None = None

    # -------------------------------------------------------------- calls on every rank
    def initialize_kv_cache(self):
        return self._run_everywhere("initialize_kv_cache")

    def initialize_kv_offload(self):
        return self._run_everywhere("initialize_kv_offload")  # each rank its own host tier / swap of its shard

    def initialize_swap_space(self):
        return self._run_everywhere("initialize_swap_space")

    def execute_model(self, scheduler_output, grammar_bitmask=None):
        if grammar_bitmask is None:
            return self._run_everywhere("execute_model", (scheduler_output,))
        return self._run_everywhere("execute_model", (scheduler_output, grammar_bitmask))  # every rank masks alike

    def reset_state(self) -> None:
        self._run_everywhere("reset_state")

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list:
        """Run ``runner.method(*args, **kwargs)`` — or ``method(runner, *args, **kwargs)`` for a
        callable (picklable by reference for ``mp``) — on every rank; returns the results in
        rank order. Raises TensorParallelWorkerError when a rank fails (fatal, as any call)."""
        return self._run_everywhere(method, args, kwargs, return_results=True)

    def _run_everywhere(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None,
                        return_results: bool = False):
        """Send the call to every worker, run it on the driver, wait for every worker's reply."""
        if self._error is not None:
            raise TensorParallelWorkerError(self._error)
        self._send(method, args, kwargs, return_results)
        try:
            result = run_on_runner(self.driver, method, args, kwargs)
        except Exception as e:  # noqa: BLE001 — the ranks are out of lock step: fatal
            self._driver_failed(method, e)
        replies = self._collect()
        return [result, *replies] if return_results else result

    def _collect(self) -> list:
        """Every worker's result (rank order); raises TensorParallelWorkerError naming the ranks
        that died, failed or did not answer within ``worker_timeout_s``."""
        results, problems = [], []
        for rank, ok, value in self._gather():
            (results if ok else problems).append(value)
        if problems:
            self._fail("; ".join(problems))
        return results

    def _driver_failed(self, method, error: Exception) -> None:
        """Rank 0 raised: leave the group (the workers' collectives fail now), gather what the
        workers say, raise TensorParallelWorkerError naming the cause first (a rank that died or
        raised on its own), then its symptoms (collectives that lost their peer)."""
        from pagedllm.distributed.parallel_state import destroy_tensor_parallel

        destroy_tensor_parallel()
        name = method if isinstance(method, str) else getattr(method, "__name__", "collective_rpc")
        reports = [f"rank 0 (the engine process) failed in {name}: {type(error).__name__}: {error}"]
        # the workers' collectives fail once rank 0 has left; one that does not notice is ended by shutdown
        reports += [value for _, ok, value in self._gather(min(self.timeout_s, _REPORT_WAIT_S)) if not ok]
        self._fail("; ".join(sorted(reports, key=is_lost_peer)), error)

    def _start_failed(self, error: BaseException) -> None:
        """Rank 0 failed while the ranks started: leave the group, raise with the workers' own
        errors first (they usually explain rank 0's)."""
        from pagedllm.distributed.parallel_state import destroy_tensor_parallel

        destroy_tensor_parallel()
        problems = [value for _, ok, value in self._gather() if not ok]
        self.shutdown()
        raise TensorParallelWorkerError("tensor-parallel start-up failed: " + "; ".join(
            problems + [f"rank 0: {type(error).__name__}: {error}"])) from error

    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        self._error = message
        logger.error("%s; the engine cannot continue", message)
        self.shutdown()
        raise TensorParallelWorkerError(message) from cause

    def shutdown(self) -> None:
        """Stop the workers and leave the group. Idempotent."""
        from pagedllm.distributed.parallel_state import destroy_tensor_parallel

        self._stop_workers()
        if self._error is None:
            self._error = "the engine has been shut down"
        destroy_tensor_parallel()

    # -------------------------------------------------------------- the transport
    def _send(self, method, args: tuple, kwargs: dict | None, return_result: bool) -> None:
        raise NotImplementedError

    def _gather(self, timeout_s: float | None = None) -> list[tuple[int, bool, Any]]:
        """(rank, True, result) or (rank, False, what went wrong) for every worker, waiting at
        most ``timeout_s`` (default ``worker_timeout_s``) for each."""
        raise NotImplementedError

    def _stop_workers(self) -> None:
        raise NotImplementedError


def is_lost_peer(report: str) -> bool:
    """Whether a rank's error is only the symptom of another rank leaving (a collective whose
    peer closed its connection), not a cause."""
    return "Connection closed by peer" in report or "Connection reset by peer" in report


def failure_summary(where: str, traceback_text: str) -> str:
    """``"<where> failed: <the exception line>"``; the whole traceback goes to the log."""
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    logger.error("%s failed:\n%s", where, traceback_text)
    return f"{where} failed: {lines[-1].strip() if lines else traceback_text}"


def _worker_main(rank: int, world_size: int, init_method: str, backend: str, config: EngineConfig,
                 conn: Connection, timeout_s: float) -> None:
    """A worker process: start, then run calls until ``shutdown`` or the engine's end of the pipe closes."""
    worker = TensorParallelWorker(rank, world_size)
    reply = worker.start(init_method, backend, config, timeout_s)
    conn.send(reply)
    if reply[0] != "ok":
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the engine is gone
            break
        if message == "shutdown":
            conn.send(("ok", None))
            break
        reply = worker.call(*message)
        conn.send(reply)
        if reply[0] != "ok":  # exiting closes this rank's connections: peers' collectives fail now
            break
    worker.stop()


class MultiprocExecutor(DistributedExecutor):
    """Rank 0 in this process plus ``tensor_parallel_size - 1`` worker processes on this machine.

    Args:
        config: the resolved EngineConfig (``max_model_len`` set); ``tensor_parallel_size``
            ranks, ``worker_timeout_s`` bounds any wait on a worker or a collective.
        model_files: the driver's model files (workers load their own from ``config.model``).

    Raises TensorParallelWorkerError when a worker fails to start (its traceback in the
    message) or dies; ValueError when nccl has fewer GPUs than ranks.
    """

    def __init__(self, config: EngineConfig, model_files) -> None:
        import torch

        from pagedllm.distributed.parallel_state import free_port, init_tensor_parallel
        from pagedllm.worker.model_runner import ModelRunner, resolve_device

        self.world_size = config.tensor_parallel_size
        self.timeout_s = float(config.worker_timeout_s)
        backend = "nccl" if resolve_device(config.device).type == "cuda" else "gloo"
        if backend == "nccl" and torch.cuda.device_count() < self.world_size:
            raise ValueError(f"tensor_parallel_size={self.world_size} needs {self.world_size} GPUs, "
                             f"found {torch.cuda.device_count()}")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")  # never fork a process that holds torch threads or CUDA
        self.workers: list[tuple[int, mp.process.BaseProcess, Connection]] = []
        for rank in range(1, self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"pagedllm-tp-rank{rank}", daemon=True,
                               args=(rank, self.world_size, init_method, backend, config, child, self.timeout_s))
            proc.start()
            child.close()
            self.workers.append((rank, proc, parent))
        self._finalizer = weakref.finalize(self, _stop_processes, self.workers)
        try:
            init_tensor_parallel(0, self.world_size, init_method, backend, self.timeout_s)
            self.driver = ModelRunner(config, model_files)
        except BaseException as e:
            self._start_failed(e)
        self._collect()
        logger.info("tensor parallel: %d ranks (%s, mp), workers %s", self.world_size, backend,
                    [p.pid for _, p, _ in self.workers])

    def _send(self, method, args, kwargs, return_result) -> None:
        payload = pickle.dumps((method, args, kwargs, return_result))  # once; a pickling error sends nothing
        for rank, proc, conn in self.workers:
            try:
                conn.send_bytes(payload)
            except (OSError, ValueError):
                proc.join(timeout=1.0)
                self._fail(_describe_gone(rank, proc, self.timeout_s))

    def _gather(self, timeout_s: float | None = None) -> list[tuple[int, bool, Any]]:
        out = []
        for rank, proc, conn in self.workers:
            wait_s = self.timeout_s if timeout_s is None else timeout_s
            ready = wait([conn, proc.sentinel], timeout=wait_s)
            if conn in ready:
                try:
                    status, detail = conn.recv()
                except (EOFError, OSError):  # its end closed: the process is gone (or going)
                    status, detail = "gone", None
                if status == "ok":
                    out.append((rank, True, detail))
                    continue
                if status == "error":
                    out.append((rank, False, failure_summary(f"tensor-parallel worker rank {rank} (pid {proc.pid})",
                                                             detail)))
                    continue
            proc.join(timeout=5.0)
            out.append((rank, False, _describe_gone(rank, proc, wait_s)))
        return out

    def _stop_workers(self) -> None:
        self._finalizer()


def _describe_gone(rank: int, proc, timeout_s: float) -> str:
    """Why worker ``rank`` cannot answer: its exit (code, or the signal that killed it) or the timeout."""
    if proc.is_alive():
        return f"tensor-parallel worker rank {rank} (pid {proc.pid}) did not answer within {timeout_s:g} s"
    code = proc.exitcode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return f"tensor-parallel worker rank {rank} (pid {proc.pid}) died ({how})"


def _stop_processes(workers: list) -> None:
    for _, proc, conn in workers:
        try:
            conn.send("shutdown")
        except (OSError, ValueError):
            pass
    for _, proc, conn in workers:
        proc.join(timeout=5.0)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5.0)
        conn.close()
