"""Executors: who runs the model runner, on how many ranks.

:class:`UniprocExecutor` — one runner in the engine process (``tensor_parallel_size=1``).

:class:`MultiprocExecutor` — ``tensor_parallel_size=N``: the engine process is rank 0 (its
runner is the *driver*, whose outputs the engine uses) and starts N-1 worker processes
(``spawn``), each building its own runner over its shard of the weights and its own KV
pool. The scheduler and KV-cache manager run once, in the engine; every call
(``initialize_kv_cache``, ``initialize_kv_offload``, ``initialize_swap_space``,
``execute_model(SchedulerOutput)``, ``reset_state``) is sent to
every worker over a pipe and run by all ranks in lock step, because the model's
collectives (all-reduce, all-gather) need every rank. Workers sample too (the same seeds and
the same full logits), so their per-request token copies stay the same as the driver's;
only the driver's output is returned.

A worker that dies (killed, out of memory, an exception) fails the executor: the call in
flight and every later one raise :class:`TensorParallelWorkerError` naming the rank, its
pid and exit code. A collective whose peer is gone errors out (gloo reports the closed
connection; ``worker_timeout_s`` bounds the rest), and waits on workers also watch their
process sentinels, so nothing hangs.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.errors import EngineDeadError

logger = logging.getLogger("pagedllm")



class TensorParallelWorkerError(EngineDeadError):
    """A tensor-parallel worker died or failed; the engine cannot run another step."""


class UniprocExecutor:
    """The runner in this process (``tensor_parallel_size=1``)."""

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

    def reset_state(self) -> None:
        self.driver.reset_state()

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig, model_files):
    """The executor ``config.tensor_parallel_size`` asks for."""
    if config.tensor_parallel_size == 1:
        return UniprocExecutor(config, model_files)
    return MultiprocExecutor(config, model_files)


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def _worker_main(rank: int, world_size: int, init_method: str, backend: str, config: EngineConfig,
                 conn: Connection, timeout_s: float) -> None:
    """A worker process: join the group, build the runner, then run calls until ``shutdown``
    or the engine's end of the pipe closes. Replies ``("ok", None)`` or ``("error", text)``."""
    import torch

    from pagedllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    try:
        torch.set_num_threads(_threads_per_rank(world_size))
        init_tensor_parallel(rank, world_size, init_method, backend, timeout_s)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        from pagedllm.loader import load_model_files
        from pagedllm.worker.model_runner import ModelRunner

        runner = ModelRunner(config, load_model_files(config.model, config.tokenizer))
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 — report any start-up failure to the engine
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):  # the engine is gone
            break
        if method == "shutdown":
            conn.send(("ok", None))
            break
        try:
            getattr(runner, method)(*args)
            conn.send(("ok", None))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
    destroy_tensor_parallel()


class MultiprocExecutor:
    """Rank 0 in this process plus ``tensor_parallel_size - 1`` worker processes.

    Args:
        config: the resolved EngineConfig (``max_model_len`` set); ``tensor_parallel_size``
            ranks, ``worker_timeout_s`` bounds any wait on a worker or a collective.
        model_files: the driver's model files (workers load their own from ``config.model``).

    Raises TensorParallelWorkerError when a worker fails to start (its traceback in the
    message) or dies.
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
        self._error: str | None = None
        for rank in range(1, self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"pagedllm-tp-rank{rank}", daemon=True,
                               args=(rank, self.world_size, init_method, backend, config, child, self.timeout_s))
            proc.start()
            child.close()
            self.workers.append((rank, proc, parent))
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers)
        try:
            init_tensor_parallel(0, self.world_size, init_method, backend, self.timeout_s)
            self.driver = ModelRunner(config, model_files)
        except BaseException as e:
            self._collect()  # a worker's own start-up error explains the driver's better
            self.shutdown()
            raise TensorParallelWorkerError(f"tensor-parallel start-up failed: {type(e).__name__}: {e}") from e
        self._collect()
        logger.info("tensor parallel: %d ranks (%s), workers %s", self.world_size, backend,
                    [p.pid for _, p, _ in self.workers])

    # -------------------------------------------------------------- calls on every rank
    def initialize_kv_cache(self):
        return self._run_everywhere("initialize_kv_cache")

    def initialize_kv_offload(self):
        return self._run_everywhere("initialize_kv_offload")  # each rank its own host tier / swap of its shard

    def initialize_swap_space(self):
        return self._run_everywhere("initialize_swap_space")

    def execute_model(self, scheduler_output, grammar_bitmask=None):
        if grammar_bitmask is None:
            return self._run_everywhere("execute_model", scheduler_output)
        return self._run_everywhere("execute_model", scheduler_output, grammar_bitmask)  # every rank masks alike

    def reset_state(self) -> None:
        self._run_everywhere("reset_state")

    def _run_everywhere(self, method: str, *args: Any):
        """Send the call to every worker, run it on the driver, wait for every worker's reply."""
        if self._error is not None:
            raise TensorParallelWorkerError(self._error)
        for rank, proc, conn in self.workers:
            try:
                conn.send((method, args))
            except (OSError, ValueError):
                proc.join(timeout=1.0)
                self._fail(_describe_gone(rank, proc, self.timeout_s))
        try:
            result = getattr(self.driver, method)(*args)
        except Exception as e:
            self._collect()  # a dead worker is the likely cause of a failed collective
            raise
        self._collect()
        return result

    def _collect(self) -> None:
        """One reply from every worker; raises TensorParallelWorkerError for a dead or failed one."""
        if self._error is not None:
            raise TensorParallelWorkerError(self._error)
        for rank, proc, conn in self.workers:
            ready = wait([conn, proc.sentinel], timeout=self.timeout_s)
            if conn in ready:
                try:
                    status, detail = conn.recv()
                except (EOFError, OSError):
                    status, detail = "error", "its pipe closed"
                if status == "ok":
                    continue
                proc.join(timeout=1.0)
                self._fail(f"tensor-parallel worker rank {rank} (pid {proc.pid}) failed: {detail}")
            proc.join(timeout=1.0)
            self._fail(_describe_gone(rank, proc, self.timeout_s))

    def _fail(self, message: str) -> None:
        self._error = message
        logger.error("%s; the engine cannot continue", message)
        self.shutdown()
        raise TensorParallelWorkerError(message)

    def shutdown(self) -> None:
        """Stop the workers (a polite request, then terminate) and leave the group. Idempotent."""
        from pagedllm.distributed.parallel_state import destroy_tensor_parallel

        self._finalizer()
        if self._error is None:
            self._error = "the engine has been shut down"
        destroy_tensor_parallel()


def _describe_gone(rank: int, proc, timeout_s: float) -> str:
    """Why worker ``rank`` cannot answer: its exit (code, or the signal that killed it) or the timeout."""
    if proc.is_alive():
        return f"tensor-parallel worker rank {rank} (pid {proc.pid}) did not answer within worker_timeout_s={timeout_s:g} s"
    code = proc.exitcode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return f"tensor-parallel worker rank {rank} (pid {proc.pid}) died ({how})"


def _stop_workers(workers: list) -> None:
    for _, proc, conn in workers:
        try:
            conn.send(("shutdown", ()))
        except (OSError, ValueError):
            pass
    for _, proc, conn in workers:
        proc.join(timeout=5.0)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5.0)
        conn.close()
