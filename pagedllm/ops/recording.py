"""Recording a forward pass's C kernel calls so a later pass replays them without the Python glue
(the CUDA-graph idea applied to ctypes calls; :class:`pagedllm.worker.cpu_graph.CpuDecodeGraphs`).

Kernel wrappers call :func:`call` / :func:`call_struct` (one thread-local lookup when nothing
records); per-step Python (the attention's plan) is recorded with :meth:`Recording.add_python`
and its torch code runs inside :meth:`Recording.allowed`, which the capture's guard lets through.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any, Callable, Iterator

import torch

__all__ = ["Recording", "call", "call_struct", "current", "recording"]

_state = threading.local()


class Recording:
    """The calls of one pass, in order: ``(fn, args)``, replayed as ``fn(*args)``.

    ``keep`` holds what the recorded pointers point into (copied structs, tensors), so it lives
    as long as the recording. ``allowed_depth`` > 0 while a wrapper runs torch code that is
    either replayed by a recorded callable or writes nothing the replay reads.
    """

    def __init__(self, empty: Callable[[list[int], torch.dtype], torch.Tensor | None] | None = None,
                 alias: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.calls: list[tuple[Callable[..., Any], tuple]] = []
        self.keep: list[Any] = []
        self.allowed_depth = 0
        self._empty, self._alias = empty, alias

    def buffer_like(self, t: torch.Tensor) -> torch.Tensor:
        """A new contiguous tensor of ``t``'s shape and dtype from the recording's memory (the capture's
        pool, reused once the pass drops it), or plain ``torch.empty`` without one."""
        out = self._empty(list(t.shape), t.dtype) if self._empty is not None else None
        return torch.empty(t.shape, dtype=t.dtype) if out is None else out

    def alias(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a recorded callable should hold it: the same memory, without keeping the pass's
        pool block in use (later calls of the pass may reuse it, after the callable in every replay)."""
        return t if self._alias is None else self._alias(t)

    def add(self, fn: Callable[..., Any], args: tuple) -> None:
        """Record ``fn(*args)`` (a ctypes function and its exact arguments)."""
        self.calls.append((fn, args))

    def add_struct(self, fn: Callable[..., Any], struct: ctypes.Structure) -> None:
        """Record ``fn(pointer to a copy of struct)``: the wrappers reuse their structs from call
        to call, so the recording keeps its own copy."""
        copy = type(struct).from_buffer_copy(struct)
        self.keep.append(copy)
        self.calls.append((fn, (ctypes.byref(copy),)))

    def add_python(self, fn: Callable[[], Any]) -> None:
        """Record a callable run with no arguments at its place in the replay."""
        self.calls.append((fn, ()))

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        """Torch ops inside are the wrapper's own business (see the class docstring)."""
        self.allowed_depth += 1
        try:
            yield
        finally:
            self.allowed_depth -= 1

    def replay(self) -> None:
        """Make every recorded call again, in order."""
        for fn, args in self.calls:
            fn(*args)


def current() -> Recording | None:
    """The recording active on this thread, or None."""
    return getattr(_state, "recording", None)


@contextlib.contextmanager
def recording(rec: Recording) -> Iterator[Recording]:
    """Record this thread's kernel calls into ``rec`` inside the block."""
    previous = current()
    _state.recording = rec
    try:
        yield rec
    finally:
        _state.recording = previous


def call(fn: Callable[..., Any], *args: Any, keep: tuple = ()) -> Any:
    """``fn(*args)``, recorded when a recording is active; ``keep``: what the arguments point
    into that the pass did not create (weights), kept alive with the recording."""
    rec = getattr(_state, "recording", None)
    if rec is not None:
        rec.add(fn, args)
        rec.keep.extend(keep)
    return fn(*args)


def call_struct(fn: Callable[..., Any], struct: ctypes.Structure, ref: Any, keep: tuple = ()) -> Any:
    """``fn(ref)`` with ``ref`` a pointer to ``struct``, recorded (with a copy of the struct) when a
    recording is active; ``keep`` as in :func:`call`."""
    rec = getattr(_state, "recording", None)
    if rec is not None:
        rec.add_struct(fn, struct)
        rec.keep.extend(keep)
    return fn(ref)
