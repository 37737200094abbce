"""The runner in the engine process (``tensor_parallel_size=1``)."""

from __future__ import annotations

from typing import Callable

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import Executor
from pagedllm.worker.worker import run_on_runner


class UniprocExecutor(Executor):
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
        return [run_on_runner(self.driver, method, args, kwargs)]

    def reset_state(self) -> None:
        self.driver.reset_state()

    def shutdown(self) -> None:
        pass
