"""The multiprocessing executor (``distributed_executor_backend="mp"``): rank 0 in the engine
process, ranks 1..N-1 as worker processes on this machine (``spawn``), calls over pipes."""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import DistributedExecutor, failure_summary
from pagedllm.worker.worker import TensorParallelWorker

logger = logging.getLogger("pagedllm")


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
        from pagedllm.utils import resolve_device
        from pagedllm.worker.model_runner import ModelRunner

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
