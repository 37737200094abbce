"""Client connection limits for uvicorn (request head size, head and body read time, idle keep-alive,
concurrency with 503 beyond) and the descriptor limit raised at start, so idle connections cannot
exhaust it."""

from __future__ import annotations

import json
import logging
from typing import Any

from pagedllm.entrypoints.openai.errors import error_body

logger = logging.getLogger("pagedllm")


class RequestHeadLimit:
    """ASGI wrapper: a request whose path and headers exceed ``max_bytes`` gets 431 and is not run."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self._head_bytes(scope) > self.max_bytes:
            body = json.dumps(error_body(431, f"the request head exceeds {self.max_bytes} bytes")).encode()
            await send({"type": "http.response.start", "status": 431,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _head_bytes(scope) -> int:
        path = scope.get("raw_path") or scope.get("path", "").encode()
        return len(path) + len(scope.get("query_string", b"")) + sum(len(k) + len(v) + 4 for k, v in scope["headers"])


def uvicorn_limits(config: Any) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments of ``config``'s connection fields (h11, whose head
    size limit uvicorn enforces)."""
    return {"http": head_timeout_protocol(config.request_head_timeout_s, config.request_body_timeout_s),
            "h11_max_incomplete_event_size": config.max_header_bytes,
            "timeout_keep_alive": config.keep_alive_timeout_s, "limit_concurrency": config.max_connections}


_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s")


def head_timeout_protocol(seconds: float, body_seconds: float | None = None) -> type:
    """uvicorn's h11 protocol closing a connection that has not sent a whole request head within
    ``seconds`` of opening or of its last response (no request of it is then running), or whose
    request body is not complete ``body_seconds`` after its head (answered 408 when no response
    has started; the handler then sees the client gone)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutH11Protocol(H11Protocol):
        _head_deadline = None
        _body_deadline = None
        _body_cycle = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._restart_head_deadline()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._cancel_head_deadline()  # a request head arrived
                self._watch_body(self.cycle)

        def _watch_body(self, cycle) -> None:
            if not cycle.more_body:
                self._cancel_body_deadline()
            elif body_seconds is not None and self._body_cycle is not cycle:
                self._cancel_body_deadline()
                self._body_cycle = cycle
                self._body_deadline = self.loop.call_later(body_seconds, self._on_body_timeout, cycle)

        def _cancel_body_deadline(self) -> None:
            if self._body_deadline is not None:
                self._body_deadline.cancel()
                self._body_deadline = None

        def _on_body_timeout(self, cycle) -> None:
            if self.cycle is not cycle or not cycle.more_body or self.transport.is_closing():
                return
            if not cycle.response_started:
                body = json.dumps(error_body(408, f"the request body did not arrive within {body_seconds} s "
                                                  "(request_body_timeout_s)")).encode()
                self.transport.write(_TIMEOUT_408 % (len(body), body))
                cycle.response_started = cycle.response_complete = True
            cycle.disconnected = True
            cycle.message_event.set()
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._restart_head_deadline()

        def connection_lost(self, exc) -> None:
            self._cancel_head_deadline()
            self._cancel_body_deadline()
            super().connection_lost(exc)

        def _restart_head_deadline(self) -> None:
            self._cancel_head_deadline()
            self._head_deadline = self.loop.call_later(seconds, self._on_head_timeout)

        def _cancel_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _on_head_timeout(self) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutH11Protocol


def raise_fd_limit() -> int:
    """Raise the soft open-file limit to the hard one (where the platform has one); returns it."""
    try:
        import resource
    except ImportError:  # not on this platform
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, e)
    return soft
