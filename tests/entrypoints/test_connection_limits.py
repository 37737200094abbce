"""Connection limits as served by uvicorn: an oversized request head is refused, concurrency beyond
the limit gets 503, idle keep-alive connections are closed; the descriptor limit is raised."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from starlette.requests import Request

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.openai.connection_limits import RequestHeadLimit, raise_fd_limit, uvicorn_limits


def test_config_fields_map_to_uvicorn():
    limits = uvicorn_limits(EngineConfig(max_connections=7, max_header_bytes=4096, keep_alive_timeout_s=3))
    from uvicorn.protocols.http.h11_impl import H11Protocol

    assert issubclass(limits.pop("http"), H11Protocol)
    assert limits == {"h11_max_incomplete_event_size": 4096, "timeout_keep_alive": 3, "limit_concurrency": 7}
    with pytest.raises(ValueError, match="max_header_bytes"):
        EngineConfig(max_header_bytes=0)


def test_the_open_file_limit_is_raised_to_the_hard_one():
    resource = pytest.importorskip("resource")
    soft = raise_fd_limit()
    now, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == now and (now == hard or hard == resource.RLIM_INFINITY)


@pytest.fixture
def served():
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/slow")
    async def slow():
        await asyncio.sleep(2.0)
        return {"ok": True}

    @app.get("/fast")
    async def fast():
        return {"ok": True}

    @app.post("/echo")
    async def echo(request: Request):
        return {"size": len(await request.body())}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    limits = EngineConfig(max_connections=2, max_header_bytes=8192, keep_alive_timeout_s=1, request_head_timeout_s=1,
                          request_body_timeout_s=1)
    config = uvicorn.Config(RequestHeadLimit(app, 8192), log_level="warning", **uvicorn_limits(limits))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def _request(port: int, path: str, extra: str = "") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data


def test_an_oversized_head_is_refused_and_normal_requests_work(served):
    assert _request(served, "/fast").startswith(b"HTTP/1.1 200")
    refused = _request(served, "/fast", f"X-Big: {'a' * 100_000}\r\n")
    assert refused.startswith(b"HTTP/1.1 431") and b'"code":431' in refused.replace(b" ", b"")
    assert _request(served, "/fast").startswith(b"HTTP/1.1 200")


def test_concurrency_beyond_the_limit_gets_503(served):
    first: list[bytes] = []
    running = threading.Thread(target=lambda: first.append(_request(served, "/slow")[:12]))
    running.start()
    time.sleep(0.6)  # the slow request holds one connection and one task: the limit of 2 is reached
    beyond = [_request(served, "/fast")[:12] for _ in range(3)]
    running.join()
    assert first == [b"HTTP/1.1 200"] and beyond == [b"HTTP/1.1 503"] * 3


def test_an_idle_keep_alive_connection_is_closed(served):
    with socket.create_connection(("127.0.0.1", served), timeout=10) as s:
        s.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n")
        t0, data = time.monotonic(), b""
        while chunk := s.recv(65536):  # the response, then the server closes the idle connection
            data += chunk
        assert data.startswith(b"HTTP/1.1 200") and data.endswith(b'{"ok":true}')
        assert 0.5 < time.monotonic() - t0 < 5


@pytest.mark.parametrize("sent", [b"", b"GET /fast HTTP/1.1\r\nHost: x\r\nX-Slow: "])
def test_a_connection_that_never_completes_its_head_is_closed(served, sent):
    with socket.create_connection(("127.0.0.1", served), timeout=10) as s:
        s.sendall(sent)
        t0 = time.monotonic()
        assert s.recv(65536) == b""  # closed, no response
        assert 0.5 < time.monotonic() - t0 < 5
    assert _request(served, "/fast").startswith(b"HTTP/1.1 200")


def test_a_slow_body_gets_408_and_is_disconnected(served):
    with socket.create_connection(("127.0.0.1", served), timeout=10) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                  b"\r\n" + b"0" * 10)  # 10 of 100 bytes, then nothing
        t0, data = time.monotonic(), b""
        while chunk := s.recv(65536):
            data += chunk
        assert data.startswith(b"HTTP/1.1 408") and b"request_body_timeout_s" in data
        assert 0.5 < time.monotonic() - t0 < 5
    # a body sent in pieces within the limit is read whole, and the server still serves
    with socket.create_connection(("127.0.0.1", served), timeout=10) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 4\r\n\r\n\"a")
        time.sleep(0.2)
        s.sendall(b"b\"")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        assert data.startswith(b"HTTP/1.1 200") and data.endswith(b'{"size":4}')
