"""One tensor-parallel rank outside the engine process (an ``mp`` worker or a Ray actor); replies are
``("ok", result)`` or ``("error", traceback text)``. After a failed call the process exits: only closing the
gloo connections wakes a peer waiting in a collective this rank never reaches."""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable

from pagedllm import envs


def threads_per_rank(world_size: int) -> int:
    """CPU threads per rank: the engine's cores (``envs.ENGINE_CORES``, default all) split among ``world_size``
    ranks, at least 1."""
    cores = envs.engine_cores() or os.cpu_count() or 1
    return max(1, cores // world_size)


def run_on_runner(runner, method: str | Callable, args: tuple, kwargs: dict | None = None) -> Any:
    """``runner.method(*args, **kwargs)``, or ``method(runner, ...)`` for a callable (vLLM's ``collective_rpc``)."""
    fn = getattr(runner, method) if isinstance(method, str) else (lambda *a, **k: method(runner, *a, **k))
    return fn(*args, **(kwargs or {}))


class TensorParallelWorker:
    """Rank ``rank`` (1..world_size-1; rank 0 is the engine process): its runner and the calls it runs."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.runner = None

    def start(self, init_method: str, backend: str, config, timeout_s: float, cuda_device: int | None = None):
        """Join the group, then build the runner over this rank's shard. Returns a reply."""
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
        """Run one call on the runner; reply ``("ok", result or None)`` or ``("error", text)`` (results only with
        ``return_result``)."""
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
