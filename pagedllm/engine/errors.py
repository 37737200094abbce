"""Errors the async engine raises to its callers; the server answers each with HTTP 503."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed or shut down); no request can be served."""


class EngineUnhealthyError(RuntimeError):
    """The engine loop runs but its steps fail (the health probe failed)."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting (``max_waiting_requests``); retry later."""
