"""Executors: who runs the model runner, on how many ranks (:mod:`.abstract` is the interface); ``uniproc``,
``mp`` (worker processes on this machine) or ``ray`` (ranks across machines).
"""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import Executor


def make_executor(config: EngineConfig, model_files) -> Executor:
    """The executor ``config.tensor_parallel_size`` and ``distributed_executor_backend`` ask for."""
    if config.tensor_parallel_size == 1:
        from pagedllm.executor.uniproc_executor import UniprocExecutor

        return UniprocExecutor(config, model_files)
    if config.distributed_executor_backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(config, model_files)
    from pagedllm.executor.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config, model_files)


__all__ = ["Executor", "make_executor"]
