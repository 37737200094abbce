"""Errors the engine raises to its callers: the server answers the RuntimeErrors with HTTP 503,
and :class:`ContextLengthError` (a ValueError, as every bad input) with 400."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed or shut down); no request can be served."""


class EngineUnhealthyError(RuntimeError):
    """The engine loop runs but its steps fail (the health probe failed)."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting (``max_waiting_requests``); retry later."""


class TensorParallelWorkerError(EngineDeadError):
    """A tensor-parallel rank died or failed; the engine cannot run another step."""


class ContextLengthError(ValueError):
    """The prompt, or the prompt plus ``max_tokens``, does not fit ``max_model_len``. Its own
    class so the server can name the field (the prompt or messages, as OpenAI does)."""
