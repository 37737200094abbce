"""Recording a forward pass's C kernel calls so a later pass replays them without the Python glue
(:class:`pagedllm.worker.cpu_graph.CpuDecodeGraphs`). Wrappers call :func:`call` / :func:`call_struct`;
per-step Python is recorded with :meth:`Recording.add_python`, its torch code inside :meth:`Recording.allowed`."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any, Callable, Iterator

import torch

__all__ = ["Recording", "call", "call_struct", "current", "recording"]

_state = threading.local()


class Recording:
    """The calls of one pass, in order: ``(fn, args)``, replayed as ``fn(*args)``. ``keep`` holds what the
    recorded pointers point into. ``allowed_depth`` > 0 while a wrapper runs torch code the replay need not see."""

    def __init__(self, empty: Callable[[list[int], torch.dtype], torch.Tensor | None] | None = None,
                 alias: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.calls: list[tuple[Callable[..., Any], tuple]] = []
        self.keep: list[Any] = []
        self.allowed_depth = 0
        self._empty, self._alias = empty, alias

    def buffer_like(self, t: torch.Tensor) -> torch.Tensor:
        """A new contiguous tensor like ``t`` from the recording's memory, or plain ``torch.empty`` without one."""
        out = self._empty(list(t.shape), t.dtype) if self._empty is not None else None
        return torch.empty(t.shape, dtype=t.dtype) if out is None else out

    def alias(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a recorded callable should hold it: the same memory, without keeping its pool block in use."""
        return t if self._alias is None else self._alias(t)

    def add(self, fn: Callable[..., Any], args: tuple) -> None:
        self.calls.append((fn, args))

    def add_struct(self, fn: Callable[..., Any], struct: ctypes.Structure) -> None:
        """Record ``fn(pointer to a copy of struct)`` (the wrappers reuse their structs)."""
        copy = type(struct).from_buffer_copy(struct)
        self.keep.append(copy)
        self.calls.append((fn, (ctypes.byref(copy),)))

    def add_python(self, fn: Callable[[], Any]) -> None:
        self.calls.append((fn, ()))

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        """Torch ops inside are the wrapper's own business."""
        self.allowed_depth += 1
        try:
            yield
        finally:
            self.allowed_depth -= 1

    def replay(self) -> None:
        for fn, args in self.calls:
            fn(*args)


def current() -> Recording | None:
    return getattr(_state, "recording", None)


@contextlib.contextmanager
def recording(rec: Recording) -> Iterator[Recording]:
    previous = current()
    _state.recording = rec
    try:
        yield rec
    finally:
        _state.recording = previous


def call(fn: Callable[..., Any], *args: Any, keep: tuple = ()) -> Any:
    """``fn(*args)``, recorded when a recording is active; ``keep``: what the arguments point into (weights)."""
    rec = getattr(_state, "recording", None)
    if rec is not None:
        rec.add(fn, args)
        rec.keep.extend(keep)
    return fn(*args)


def call_struct(fn: Callable[..., Any], struct: ctypes.Structure, ref: Any, keep: tuple = ()) -> Any:
    """``fn(ref)`` with ``ref`` a pointer to ``struct``, recorded with a copy of the struct; ``keep`` as in
    :func:`call`."""
    rec = getattr(_state, "recording", None)
    if rec is not None:
        rec.add_struct(fn, struct)
        rec.keep.extend(keep)
    return fn(ref)
