"""A CPU decode graph's native replay (``native/graph_replay.c``): the recorded calls' task forms
(``native/native_team.h``) run in one C loop inside one OpenMP parallel region per step, the team's threads
spinning between calls, instead of one ctypes call and one parallel region per kernel.

:class:`Program` is built from a :class:`~pagedllm.ops.recording.Recording` whose every call has a task form
(:attr:`Recording.tasks` is not None); its per-step fields (attention's block tables, sequence lengths, slots) are
refreshed by the recording's refresh hooks before each run.
"""

from __future__ import annotations

import ctypes
import threading

from pagedllm import envs, native
from pagedllm.ops.recording import Recording

__all__ = ["GraphReplayError", "Program", "available", "kernel"]

_SOURCE = native.SOURCE_DIR / "graph_replay.c"
_ABI_VERSION = 1


class ReplayEntry(ctypes.Structure):
    """``struct replay_entry``: a task form, its argument struct, the threads it may use."""

    _fields_ = [("fn", ctypes.c_void_p), ("args", ctypes.c_void_p), ("nth", ctypes.c_int)]


class GraphReplayError(RuntimeError):
    """A task of a native replay returned non-zero (a scratch allocation failed, or a kernel refused its
    arguments); the step's outputs are not to be used."""


class GraphReplayKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.pagedllm_graph_replay_abi_version.restype = ctypes.c_int
        if lib.pagedllm_graph_replay_abi_version() != _ABI_VERSION:
            raise OSError(f"{_SOURCE.name}: ABI version mismatch")
        lib.pagedllm_graph_replay_openmp.restype = ctypes.c_int
        self.has_openmp = bool(lib.pagedllm_graph_replay_openmp())
        self.replay = lib.graph_replay
        self.replay.argtypes = [ctypes.POINTER(ReplayEntry), ctypes.c_int, ctypes.c_int]
        self.replay.restype = ctypes.c_int


_load_lock = threading.Lock()
_kernel: list[GraphReplayKernel | None] = []


def kernel() -> GraphReplayKernel | None:
    """The loaded library, or None when it cannot be built (logged once)."""
    if not _kernel:
        with _load_lock:
            if not _kernel:
                _kernel.append(native.load_kernels(_SOURCE, GraphReplayKernel, "CPU graph native replay",
                                                   "the Python replay"))
    return _kernel[0]


def available() -> bool:
    """Whether native replays run here: ``envs.CPU_GRAPH_NATIVE_REPLAY`` on and the library built."""
    return envs.cpu_graph_native_replay() and kernel() is not None


class Program:
    """``rec``'s task forms as one entry array, run on ``num_threads`` threads. Raises ValueError for a
    recording with a call that has no task form."""

    def __init__(self, rec: Recording, num_threads: int) -> None:
        if rec.tasks is None:
            raise ValueError("Program: the recording has a call without a task form")
        self.kernel = kernel()
        self.num_threads = num_threads
        self.rec = rec
        self.entries = (ReplayEntry * len(rec.tasks))(
            *(ReplayEntry(t.fn, ctypes.addressof(t.args), max(1, min(t.nth, num_threads))) for t in rec.tasks))
        self.names = [t.name for t in rec.tasks]

    def refresh(self) -> bool:
        """Run the recording's refresh hooks; False when one says this step's calls differ from the recorded ones
        (the caller replays from Python instead)."""
        return self.rec.refresh()

    def run(self) -> None:
        """Raises GraphReplayError naming the first failing call."""
        status = self.kernel.replay(self.entries, len(self.entries), self.num_threads)
        if status:
            raise GraphReplayError(f"CPU decode graph: recorded call {status - 1} ({self.names[status - 1]}) failed")
