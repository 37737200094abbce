"""AsyncPoolingEngine: the async front's engine thread, health, stats and shutdown, driving a
:class:`~pagedllm.engine.pooling_engine.PoolingEngine`. A pooling request is one future settled with
its :class:`~pagedllm.outputs.PoolingRequestOutput`; concurrent requests share the engine's steps."""

from __future__ import annotations

import asyncio
import time

from pagedllm.engine.async_engine import AsyncLLMEngine, _CallCommand
from pagedllm.errors import EngineDeadError, EngineOverloadedError
from pagedllm.outputs import PoolingRequestOutput


class AsyncPoolingEngine(AsyncLLMEngine):
    runner_type = "pooling"

    def __init__(self, engine, **kwargs) -> None:
        super().__init__(engine, **kwargs)
        self._pooled: dict[str, asyncio.Future] = {}

    @property
    def tasks(self) -> tuple[str, ...]:
        return self.engine.tasks

    async def add_requests(self, *args, **kwargs):
        """Generation is refused: raises ValueError naming the runner (a 400 over HTTP)."""
        raise ValueError(f"the model {self.model_name!r} runs with runner='pooling' (it serves "
                         f"{', '.join(self.tasks)}); text generation needs a model served with runner='generate'")

    async def encode(self, label: str, task: str, encoded: list[tuple[list[int], list[int] | None]]
                     ) -> list[PoolingRequestOutput]:
        """Pool every encoded prompt for ``task``; outputs in order. Raises ValueError for a rejected
        prompt or one that failed in the engine (nothing stays queued), EngineOverloadedError,
        EngineDeadError. Cancelling aborts them."""
        if self.max_waiting_requests is not None and self.num_waiting_estimate() >= self.max_waiting_requests:
            raise EngineOverloadedError(f"the server is overloaded: {self.num_waiting_estimate()} requests are "
                                        f"waiting (max_waiting_requests={self.max_waiting_requests}); retry later")
        ids = [f"{label}-{next(self._ids)}" for _ in encoded]
        futures = [self._loop_future() for _ in ids]
        self._pooled.update(zip(ids, futures))
        t0 = time.time()
        try:
            await self.call(lambda engine: _add_all(engine, ids, task, encoded))
            outputs = list(await asyncio.gather(*futures))
        except BaseException:
            self._submit(_CallCommand(lambda engine: engine.abort_request(ids), self._loop_future()))
            raise
        finally:
            for rid in ids:
                self._pooled.pop(rid, None)
        failed = [o.error for o in outputs if o.error]
        if failed:
            raise RuntimeError(f"the pooling step failed: {failed[0]}")
        if self.metrics is not None:
            for out in outputs:
                self.metrics.record_finished("pooled", time.time() - t0, None, len(out.prompt_token_ids), 0, None)
        return outputs

    async def _probe(self) -> str | None:
        try:
            await self.encode("health-probe", self.tasks[0], [([0], None)])
        except EngineDeadError:
            raise
        except (ValueError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    def _loop_future(self) -> asyncio.Future:
        self.start()
        return self._loop.create_future()

    def _step(self) -> None:
        outputs = self.engine.step()
        if outputs:
            self._last_step_failed = all(o.error is not None for o in outputs)
            self._loop.call_soon_threadsafe(self._settle_pooled, outputs)
        if self.metrics is not None:
            self.metrics.set_healthy(not self._last_step_failed)

    def _settle_pooled(self, outputs: list[PoolingRequestOutput]) -> None:
        for out in outputs:
            future = self._pooled.get(out.request_id)
            if future is not None:
                self._settle(future, out)

    def _fail_all(self, error: BaseException) -> None:
        super()._fail_all(error)
        for future in list(self._pooled.values()):
            self._settle(future, None, error)


def _add_all(engine, ids: list[str], task: str, encoded) -> None:
    added = []
    try:
        for i, (rid, (tokens, types)) in enumerate(zip(ids, encoded)):
            engine.add_request(rid, tokens, task, types)
            added.append(rid)
    except ValueError as e:
        engine.abort_request(added)
        raise ValueError(f"input[{i}]: {e}" if len(ids) > 1 else str(e)) from None


def make_async_engine(engine, **kwargs) -> AsyncLLMEngine:
    """The async front for ``engine``: an :class:`AsyncPoolingEngine` for a pooling engine."""
    if getattr(engine, "runner_type", "generate") == "pooling":
        return AsyncPoolingEngine(engine, **kwargs)
    return AsyncLLMEngine(engine, **kwargs)
