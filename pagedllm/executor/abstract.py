"""The executor interface: who runs the model runner, on how many ranks. With several ranks every call
runs on all in lock step and a failure on any rank is fatal (vLLM's rule): every later call raises
:class:`~pagedllm.errors.TensorParallelWorkerError` naming the rank and the cause."""

from __future__ import annotations

import logging
from typing import Any, Callable

from pagedllm.errors import TensorParallelWorkerError
from pagedllm.worker.worker import run_on_runner

logger = logging.getLogger("pagedllm")
# After rank 0 failed: how long to wait for the workers' own reports before stopping them.
_REPORT_WAIT_S = 30.0


class Executor:
    """The calls the engine makes on its model runner(s); ``driver`` is rank 0's runner."""

    world_size: int
    driver: Any

    def initialize_kv_cache(self):
        raise NotImplementedError

    def initialize_kv_offload(self):
        raise NotImplementedError

    def initialize_swap_space(self):
        raise NotImplementedError

    def execute_model(self, scheduler_output, grammar_bitmask=None):
        raise NotImplementedError

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list:
        """``runner.method(*args, **kwargs)`` (or ``method(runner, ...)``) on every rank, results in rank order."""
        raise NotImplementedError

    def reset_state(self) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop every rank but this one. Idempotent."""
        raise NotImplementedError


class DistributedExecutor(Executor):
    """Rank 0 (the driver) in this process plus workers elsewhere; a subclass sets ``world_size``,
    ``timeout_s`` and ``driver`` and implements :meth:`_send` and :meth:`_gather`."""

    world_size: int
    timeout_s: float
    driver: Any
    _error: str | None = None

    def initialize_kv_cache(self):
        return self._run_everywhere("initialize_kv_cache")

    def initialize_kv_offload(self):
        return self._run_everywhere("initialize_kv_offload")

    def initialize_swap_space(self):
        return self._run_everywhere("initialize_swap_space")

    def execute_model(self, scheduler_output, grammar_bitmask=None):
        if grammar_bitmask is None:
            return self._run_everywhere("execute_model", (scheduler_output,))
        return self._run_everywhere("execute_model", (scheduler_output, grammar_bitmask))

    def reset_state(self) -> None:
        self._run_everywhere("reset_state")

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list:
        return self._run_everywhere(method, args, kwargs, return_results=True)

    def _run_everywhere(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None,
                        return_results: bool = False):
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
        """Every worker's result (rank order); raises naming the ranks that died, failed or timed out."""
        results, problems = [], []
        for rank, ok, value in self._gather():
            (results if ok else problems).append(value)
        if problems:
            self._fail("; ".join(problems))
        return results

    def _driver_failed(self, method, error: Exception) -> None:
        """Rank 0 raised: leave the group and raise with the causes first, then the symptoms."""
        from pagedllm.distributed.parallel_state import destroy_tensor_parallel

        destroy_tensor_parallel()
        name = method if isinstance(method, str) else getattr(method, "__name__", "collective_rpc")
        reports = [f"rank 0 (the engine process) failed in {name}: {type(error).__name__}: {error}"]
        reports += [value for _, ok, value in self._gather(min(self.timeout_s, _REPORT_WAIT_S)) if not ok]
        self._fail("; ".join(sorted(reports, key=is_lost_peer)), error)

    def _start_failed(self, error: BaseException) -> None:
        """Rank 0 failed while the ranks started: raise with the workers' errors first."""
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

    def _send(self, method, args: tuple, kwargs: dict | None, return_result: bool) -> None:
        raise NotImplementedError

    def _gather(self, timeout_s: float | None = None) -> list[tuple[int, bool, Any]]:
        """(rank, True, result) or (rank, False, what went wrong) for every worker, at most ``timeout_s`` each."""
        raise NotImplementedError

    def _stop_workers(self) -> None:
        raise NotImplementedError


def is_lost_peer(report: str) -> bool:
    """Whether a rank's error is only the symptom of another rank leaving, not a cause."""
    return "Connection closed by peer" in report or "Connection reset by peer" in report


def failure_summary(where: str, traceback_text: str) -> str:
    """``"<where> failed: <the exception line>"``; the whole traceback goes to the log."""
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    logger.error("%s failed:\n%s", where, traceback_text)
    return f"{where} failed: {lines[-1].strip() if lines else traceback_text}"
