"""Recording a forward pass's C kernel calls so a later pass replays them without the Python glue
(:class:`pagedllm.worker.cpu_graph.CpuDecodeGraphs`). Wrappers call :func:`call` / :func:`call_struct`;
per-step Python is recorded with :meth:`Recording.add_python`, its torch code inside :meth:`Recording.allowed`.

A call recorded with its task form (``task=(pointer, threads)``, ``native/native_team.h``) also joins
:attr:`Recording.tasks`, which :class:`pagedllm.ops.graph_replay.Program` runs in one C loop; a call recorded without
one (Python, or a kernel with no task form) leaves the recording to the Python replay alone."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import torch

__all__ = ["TEAM", "Recording", "Task", "call", "call_struct", "current", "recording", "task_pointer"]

_state = threading.local()
TEAM = 1 << 30  # a task's thread count meaning "every thread of the replay's team"


@dataclass(frozen=True)
class Task:
    """One recorded call's task form: ``fn(&args, ith, n)`` for each of ``n = min(nth, team)`` threads."""

    fn: int
    args: ctypes.Structure
    nth: int
    name: str


def task_pointer(lib: ctypes.CDLL, name: str) -> int:
    """The address of ``lib``'s task form ``name`` (``int name(const void *, int, int)``). Raises AttributeError
    when the library lacks it."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


_arg_structs: dict[tuple, type] = {}


def _args_struct(argtypes: tuple) -> type:
    """A ctypes Structure whose fields are ``argtypes`` in order: the C struct of a positional kernel's
    parameters (each task form's ``struct <kernel>_args``) has this layout."""
    struct = _arg_structs.get(argtypes)
    if struct is None:
        struct = _arg_structs[argtypes] = type("KernelArgs", (ctypes.Structure,),
                                               {"_fields_": [(f"a{i}", t) for i, t in enumerate(argtypes)]})
    return struct


class Recording:
    """The calls of one pass, in order: ``(fn, args)``, replayed as ``fn(*args)``. ``keep`` holds what the
    recorded pointers point into. ``allowed_depth`` > 0 while a wrapper runs torch code the replay need not see.
    ``tasks``: the same calls as task forms, None once a call without one was recorded; ``refreshes``: per key,
    the hook giving a step's values of some task arguments and the structs it writes them into."""

    def __init__(self, empty: Callable[[list[int], torch.dtype], torch.Tensor | None] | None = None,
                 alias: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.calls: list[tuple[Callable[..., Any], tuple]] = []
        self.keep: list[Any] = []
        self.tasks: list[Task] | None = []
        self.untasked: str | None = None  # the first call recorded without a task form
        self.refreshes: dict[Hashable, tuple[Callable[[], dict[str, int] | None], list[ctypes.Structure]]] = {}
        self.allowed_depth = 0
        self._empty, self._alias = empty, alias

    def buffer_like(self, t: torch.Tensor) -> torch.Tensor:
        """A new contiguous tensor like ``t`` from the recording's memory, or plain ``torch.empty`` without one."""
        out = self._empty(list(t.shape), t.dtype) if self._empty is not None else None
        return torch.empty(t.shape, dtype=t.dtype) if out is None else out

    def alias(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a recorded callable should hold it: the same memory, without keeping its pool block in use."""
        return t if self._alias is None else self._alias(t)

    def add(self, fn: Callable[..., Any], args: tuple, task: tuple[int, int] | None = None) -> None:
        self.calls.append((fn, args))
        argtypes = getattr(fn, "argtypes", None)  # None: not a ctypes function (a wrapped one)
        if task is None or argtypes is None:
            self._no_task(fn)
        elif self.tasks is not None:
            struct = _args_struct(tuple(argtypes))(*args)
            self.tasks.append(Task(task[0], struct, task[1], fn.__name__))

    def add_struct(self, fn: Callable[..., Any], struct: ctypes.Structure, task: tuple[int, int] | None = None) -> None:
        """Record ``fn(pointer to a copy of struct)`` (the wrappers reuse their structs)."""
        copy = type(struct).from_buffer_copy(struct)
        self.keep.append(copy)
        self.calls.append((fn, (ctypes.byref(copy),)))
        if task is None:
            self._no_task(fn)
        elif self.tasks is not None:
            self.tasks.append(Task(task[0], copy, task[1], fn.__name__))

    def add_python(self, fn: Callable[[], Any], tasks: list[Task] | None = None,
                   refresh: tuple[Hashable, Callable[[], dict[str, int] | None]] | None = None) -> None:
        """``fn`` for the Python replay; ``tasks`` (run in order) for the native one, their per-step fields
        written by ``refresh = (key, hook)``: the hook returns field name -> value for this step, or None when
        this step's calls would differ from the recorded ones. Hooks sharing a key run once per step."""
        self.calls.append((fn, ()))
        if tasks is None:
            self._no_task(fn)
            return
        if self.tasks is None:
            return
        self.tasks.extend(tasks)
        if refresh is not None:
            key, hook = refresh
            structs = self.refreshes.setdefault(key, (hook, []))[1]
            for t in tasks:
                if not any(t.args is s for s in structs):
                    structs.append(t.args)

    def _no_task(self, fn: Callable[..., Any]) -> None:
        if self.tasks is not None:
            self.untasked = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
        self.tasks = None

    def refresh(self) -> bool:
        """Write this step's per-step fields into the tasks' structs; False when a hook declines."""
        for hook, structs in self.refreshes.values():
            values = hook()
            if values is None:
                return False
            for struct in structs:
                for name, value in values.items():
                    setattr(struct, name, value)
        return True

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


def call(fn: Callable[..., Any], *args: Any, keep: tuple = (), task: tuple[int, int] | None = None) -> Any:
    """``fn(*args)``, recorded when a recording is active; ``keep``: what the arguments point into (weights);
    ``task``: (task form pointer, threads it may use), its struct built from ``args`` by ``fn.argtypes``."""
    rec = getattr(_state, "recording", None)
    if rec is not None:
        rec.add(fn, args, task)
        rec.keep.extend(keep)
    return fn(*args)


def call_struct(fn: Callable[..., Any], struct: ctypes.Structure, ref: Any, keep: tuple = (),
                task: tuple[int, int] | None = None) -> Any:
    """``fn(ref)`` with ``ref`` a pointer to ``struct``, recorded with a copy of the struct; ``keep`` and ``task``
    as in :func:`call` (the task form takes the same struct)."""
    rec = getattr(_state, "recording", None)
    if rec is not None:
        rec.add_struct(fn, struct, task)
        rec.keep.extend(keep)
    return fn(ref)
