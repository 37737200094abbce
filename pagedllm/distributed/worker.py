"""One tensor-parallel rank outside the engine process: a worker process (``mp``) or a Ray
actor (``ray``) wraps a :class:`TensorParallelWorker`.

The worker joins the group, builds its :class:`~pagedllm.worker.model_runner.ModelRunner`
over its shard, then runs the calls the executor sends, in the engine's order. Every reply is
``("ok", result)`` or ``("error", traceback text)``, so both transports report failures the
same way.

A call that raises leaves the ranks out of lock step (a peer may be waiting in a collective
this rank will never reach), so after replying the worker's process exits: the closed gloo
connections make every peer's pending collective fail at once ("Connection reset by peer")
instead of after ``worker_timeout_s`` (leaving the process group is not enough: a peer's
pending receive is not woken by it), and the engine fails with this rank's error.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable


# The cores one engine may use; a data-parallel replica sets it to its share of the machine so
# its tensor-parallel ranks split that share, not the whole machine.
ENGINE_CORES_ENV = "PAGEDLLM_ENGINE_CORES"


def threads_per_rank(world_size: int) -> int:
    """CPU threads each rank's torch uses: the engine's cores (``$PAGEDLLM_ENGINE_CORES``, default
    all of this machine's) shared out among the ``world_size`` ranks, at least one."""
    cores = int(os.environ.get(ENGINE_CORES_ENV) or 0) or os.cpu_count() or 1
    return max(1, cores // world_size)


def run_on_runner(runner, method: str | Callable, args: tuple, kwargs: dict | None = None) -> Any:
    """``runner.method(*args, **kwargs)``, or ``method(runner, *args, **kwargs)`` for a callable
    (vLLM's ``collective_rpc`` convention)."""
    fn = getattr(runner, method) if isinstance(method, str) else (lambda *a, **k: method(runner, *a, **k))
    return fn(*args, **(kwargs or {}))


class TensorParallelWorker:
    """Rank ``rank`` of ``world_size``: its runner and the calls it runs.

    Args:
        rank: 1..world_size-1 (rank 0 is the engine process).
        world_size: the tensor-parallel size.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.runner = None

    def start(self, init_method: str, backend: str, config, timeout_s: float, cuda_device: int | None = None):
        """Join the group (blocks until every rank has), then build the runner (loads this
        rank's shard). ``cuda_device``: the GPU index to use with ``nccl``. Returns a reply."""
        try:
            import torch

            from pagedllm.distributed.parallel_state import init_tensor_parallel
            from pagedllm.loader import load_model_files
            from pagedllm.worker.model_runner import ModelRunner

            if backend != "nccl":
                torch.set_num_threads(threads_per_rank(self.world_size))
            init_tensor_parallel(self.rank, self.world_size, init_method, backend, timeout_s)
            if backend == "nccl":
                torch.cuda.set_device(self.rank if cuda_device is None else cuda_device)
            self.runner = ModelRunner(config, load_model_files(config.model, config.tokenizer))
            return "ok", os.getpid()
        except BaseException:  # noqa: BLE001 — report any start-up failure to the engine
            self._leave_group()
            return "error", traceback.format_exc()

    def call(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None,
             return_result: bool = False):
        """Run one call on the runner; reply ``("ok", result or None)`` or ``("error", text)``.

        ``execute_model``'s output stays here (the engine uses rank 0's), so only calls that
        ask for it (``return_result``: ``collective_rpc``) ship a result back.
        """
        try:
            result = run_on_runner(self.runner, method, args, kwargs)
            return "ok", (result if return_result else None)
        except BaseException:  # noqa: BLE001 — any failure ends this rank (its process exits after replying)
            return "error", traceback.format_exc()

    def stop(self) -> None:
        """Leave the group (idempotent)."""
        self._leave_group()

    @staticmethod
    def _leave_group() -> None:
        from pagedllm.distributed.parallel_state import destroy_tensor_parallel

        try:
            destroy_tensor_parallel()
        except Exception:  # noqa: BLE001 — already broken: nothing left to close
            pass
