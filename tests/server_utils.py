"""The HTTP server on a free loopback port around an engine, and the assertions every server test shares."""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx
import uvicorn

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.lifecycle import DrainingServer
from pagedllm.metrics import EngineMetrics
from fake_engine import FakeEngine

MODEL = "fake-model"


class ServerThread:
    """uvicorn serving ``app`` in a background thread on a free loopback port (context manager).

    With ``drain_timeout_s`` the server is a DrainingServer (``server.handle_exit`` drains).
    """

    def __init__(self, app, drain_timeout_s: float | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        if drain_timeout_s is None:
            self.server = uvicorn.Server(config)
        else:
            self.server = DrainingServer(config, app.state.engine, app.state.in_flight, drain_timeout_s)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def make_server(fake: FakeEngine | None = None, drain_timeout_s: float | None = None,
                **kwargs) -> tuple[ServerThread, FakeEngine]:
    fake = fake or FakeEngine()
    engine = AsyncLLMEngine(fake, metrics=EngineMetrics(MODEL), stats_log_interval_s=0)
    return ServerThread(build_app(engine, [MODEL], **kwargs), drain_timeout_s), fake


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body, in order."""
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


def assert_error(resp: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["code"] == status
    assert "Traceback" not in resp.text
    if status < 500:  # bad input: no Python class names either
        assert not re.search(r"\b[A-Z]\w*(Error|Exception)\b", err["message"]), err
    if param != "any":
        assert err["param"] == param, err
    return err
