"""Graceful shutdown of the server: on SIGINT/SIGTERM stop taking requests (503), let those in
flight finish for up to ``drain_timeout_s``, then end the rest (streams with an in-band error
event and ``data: [DONE]``, others with a 503) and exit. A second signal exits at once."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import uvicorn

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.errors import error_response, is_anthropic_path

logger = logging.getLogger("pagedllm.server")

SHUTDOWN_MESSAGE = "the server is shutting down"
_FLUSH_TIMEOUT_S = 5.0  # time for the ended responses to reach their clients
_ALWAYS_OPEN = ("/metrics",)  # scrapers may watch the drain


@dataclass
class InFlight:
    """HTTP requests in flight (a streamed one until its last byte), and whether the server drains."""

    num_in_flight: int = 0
    is_draining: bool = False


class InFlightMiddleware:
    """Pure-ASGI middleware that keeps :class:`InFlight` and answers 503 while draining."""

    def __init__(self, app: Any, state: InFlight) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.is_draining and not scope["path"].startswith(_ALWAYS_OPEN):
            response = error_response(503, SHUTDOWN_MESSAGE, anthropic=is_anthropic_path(scope["path"]))
            await response(scope, receive, send)
            return
        self.state.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_in_flight -= 1


async def drain(engine: AsyncLLMEngine, in_flight: InFlight, timeout_s: float) -> None:
    """Refuse new requests, wait up to ``timeout_s`` for those in flight, then end the rest."""
    in_flight.is_draining = True
    logger.info("shutting down: %d requests in flight, waiting up to %g s", in_flight.num_in_flight, timeout_s)
    await _wait_idle(in_flight, timeout_s)
    if in_flight.num_in_flight:
        logger.info("ending %d requests still in flight", in_flight.num_in_flight)
        await engine.shutdown(reason=SHUTDOWN_MESSAGE)
        await _wait_idle(in_flight, _FLUSH_TIMEOUT_S)


async def _wait_idle(in_flight: InFlight, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while in_flight.num_in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGINT/SIGTERM drains (see :func:`drain`) before it exits.

    Args:
        config: the uvicorn config.
        engine, in_flight: what :func:`drain` needs.
        drain_timeout_s: the most seconds requests in flight get to finish.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, in_flight: InFlight,
                 drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.in_flight = in_flight
        self.drain_timeout_s = drain_timeout_s
        self._is_drain_requested = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        """Signal handler (also safe to call from another thread): first call drains, later ones exit."""
        if self._is_drain_requested:
            super().handle_exit(sig, frame)
        self._is_drain_requested = True
        self.in_flight.is_draining = True  # refuse new requests from now on, not from the next tick

    async def on_tick(self, counter: int) -> bool:
        if self._is_drain_requested and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(drain(self.engine, self.in_flight, self.drain_timeout_s))
        if self._drain_task is not None and self._drain_task.done():
            self.should_exit = True
        return await super().on_tick(counter)
