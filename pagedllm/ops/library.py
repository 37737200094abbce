"""The fused CPU kernels' library (``native/cpu_ops.c``) and its switch ``envs.CPU_FUSED_OPS`` /
:func:`set_enabled`. Off during a torch.compile trace: inductor fuses the torch code, a ctypes call breaks the graph.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from pagedllm import envs, native
from pagedllm.ops.calls import ActAndMulCall, RmsNormCall, RopeQkCall
from pagedllm.ops.recording import task_pointer

__all__ = ["CpuOps", "can_run", "cpu_ops", "num_threads_for", "set_enabled"]

_SOURCE = native.SOURCE_DIR / "cpu_ops.c"
_ABI_VERSION = 3
# Elements per thread below which a kernel runs on the calling thread (waking the OpenMP team costs more).
_ELEMENTS_PER_THREAD = 262144

_p, _i, _ssize, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_ssize_t, ctypes.c_float
# argument orders: cpu_ops.c
_RMS_NORM_ARGS = [_p, _p, _p, _p, _p, _i, _i, _ssize, _ssize, _ssize, _f, _i, _i]
_ACT_AND_MUL_ARGS = [_p, _p, _i, _i, _ssize, _ssize, _i, _i]
_ROPE_QK_ARGS = [_p, _ssize, _p, _ssize, _p, _ssize, _i, _i, _i, _i, _i, _p, _p, _f, _i, _i]
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


class CpuOps:
    """The loaded kernels, one ctypes function per dtype (they release the GIL and trust their arguments),
    the ``*_call`` forms taking one struct, and the ``*_task`` forms' addresses (the same struct)."""

    dtypes = tuple(_SUFFIXES)

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.pagedllm_cpu_ops_abi_version.restype = _i
        if lib.pagedllm_cpu_ops_abi_version() != _ABI_VERSION:
            raise OSError(f"{_SOURCE.name}: ABI version mismatch")
        lib.pagedllm_cpu_ops_max_head_dim.restype = _i
        self.max_head_dim: int = lib.pagedllm_cpu_ops_max_head_dim()
        self.rms_norm = self._functions(lib, "rms_norm", _RMS_NORM_ARGS)
        self.act_and_mul = self._functions(lib, "act_and_mul", _ACT_AND_MUL_ARGS)
        self.rope_qk = self._functions(lib, "rope_qk", _ROPE_QK_ARGS)
        self.rms_norm_call = self._functions(lib, "rms_norm", [ctypes.POINTER(RmsNormCall)], "_call")
        self.act_and_mul_call = self._functions(lib, "act_and_mul", [ctypes.POINTER(ActAndMulCall)], "_call")
        self.rope_qk_call = self._functions(lib, "rope_qk", [ctypes.POINTER(RopeQkCall)], "_call")
        # task forms (native/native_team.h) for a CPU decode graph's native replay, one per kernel and dtype
        self.rms_norm_task, self.act_and_mul_task, self.rope_qk_task = (
            {dtype: task_pointer(lib, f"{name}_{suffix}_task") for dtype, suffix in _SUFFIXES.items()}
            for name in ("rms_norm", "act_and_mul", "rope_qk"))
        self._lib = lib

    @staticmethod
    def _functions(lib: ctypes.CDLL, name: str, argtypes: list, variant: str = "") -> dict[torch.dtype, ctypes._CFuncPtr]:
        functions = {}
        for dtype, suffix in _SUFFIXES.items():
            fn = getattr(lib, f"{name}_{suffix}{variant}")
            fn.argtypes, fn.restype = argtypes, None
            functions[dtype] = fn
        return functions


_load_lock = threading.Lock()
_ops: list[CpuOps | None] = []
_enabled: bool | None = None  # None: read the switch at the next call


def cpu_ops() -> CpuOps | None:
    """The kernels, or None when switched off, while torch.compile traces, or when they cannot load (logged once)."""
    global _enabled
    if torch.compiler.is_compiling():  # first: a traced read of _enabled would become a guard on its value
        return None
    if _enabled is None:
        _enabled = envs.cpu_fused_ops()
    if not _enabled:
        return None
    if not _ops:
        with _load_lock:
            if not _ops:
                _ops.append(_load())
    return _ops[0]


def set_enabled(enabled: bool | None) -> None:
    """Switch the kernels on or off for this process; None: follow ``envs.CPU_FUSED_OPS`` again."""
    global _enabled
    _enabled = enabled


def _load() -> CpuOps | None:
    return native.load_kernels(_SOURCE, CpuOps, "fused CPU kernels", "the PyTorch code")


def num_threads_for(num_elements: int) -> int:
    """Threads for a kernel over ``num_elements`` elements: torch's intra-op count, fewer for small work."""
    if num_elements < 2 * _ELEMENTS_PER_THREAD:
        return 1
    return max(1, min(torch.get_num_threads(), num_elements // _ELEMENTS_PER_THREAD))


def can_run(*tensors: torch.Tensor) -> bool:
    """Whether tensors may go to a kernel: on the CPU, not tracked by autograd (the kernels have no backward)."""
    if torch.is_grad_enabled():
        return all(t.is_cpu and not t.requires_grad for t in tensors)
    return all(t.is_cpu for t in tensors)
