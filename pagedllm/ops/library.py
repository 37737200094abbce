"""The fused CPU kernels' library (``native/cpu_ops.c``, built on first use) and the switch that turns
them off: ``envs.CPU_FUSED_OPS`` (read at the first kernel call) or :func:`set_enabled`. Off during
a torch.compile trace too: inductor fuses the torch code itself, and a ctypes call breaks the graph.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from pagedllm import envs, native
from pagedllm.ops.calls import ActAndMulCall, RmsNormCall, RopeQkCall

__all__ = ["CpuOps", "can_run", "cpu_ops", "num_threads_for", "set_enabled"]

_SOURCE = native.SOURCE_DIR / "cpu_ops.c"
_ABI_VERSION = 2
# Elements per thread below which a kernel runs on the calling thread: waking the sleeping OpenMP
# team and waiting for its slowest thread costs more than a decode step's rows.
_ELEMENTS_PER_THREAD = 262144

_p, _i, _ssize, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_ssize_t, ctypes.c_float
# rms_norm_<dtype>(x, x_weight, residual, weight, out, num_rows, dim, x_stride, residual_stride, out_stride, eps,
#   gemma, num_threads)
_RMS_NORM_ARGS = [_p, _p, _p, _p, _p, _i, _i, _ssize, _ssize, _ssize, _f, _i, _i]
# act_and_mul_<dtype>(in, out, num_rows, inter, in_stride, out_stride, act, num_threads)
_ACT_AND_MUL_ARGS = [_p, _p, _i, _i, _ssize, _ssize, _i, _i]
# rope_qk_<dtype>(qkv, qkv_stride, q_out, q_out_stride, cos_sin, cos_sin_stride, num_tokens, num_heads,
#   num_kv_heads, head_dim, rotary_dim, q_weight, k_weight, eps, norm_kind, num_threads)
_ROPE_QK_ARGS = [_p, _ssize, _p, _ssize, _p, _ssize, _i, _i, _i, _i, _i, _p, _p, _f, _i, _i]
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


class CpuOps:
    """The loaded kernels, one function per dtype: ``rms_norm[dtype]``, ``act_and_mul[dtype]``,
    ``rope_qk[dtype]`` (ctypes functions; they release the GIL). The callers in this package check
    every argument; the kernels trust them. ``max_head_dim`` bounds ``rope_qk``'s head size.
    ``rms_norm_call``, ``act_and_mul_call``, ``rope_qk_call``: the same kernels taking their
    arguments as one struct (:mod:`pagedllm.ops.calls`)."""

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
        self._lib = lib  # keep the library loaded

    @staticmethod
    def _functions(lib: ctypes.CDLL, name: str, argtypes: list, variant: str = "") -> dict[torch.dtype, ctypes._CFuncPtr]:
        functions = {}
        for dtype, suffix in _SUFFIXES.items():
            fn = getattr(lib, f"{name}_{suffix}{variant}")
            fn.argtypes, fn.restype = argtypes, None
            functions[dtype] = fn
        return functions


_load_lock = threading.Lock()
_ops: list[CpuOps | None] = []  # [] until the first load, then [ops or None]
_enabled: bool | None = None  # None: read the switch at the next call (not per call: it costs more than a kernel)


def cpu_ops() -> CpuOps | None:
    """The kernels, or None when they are switched off (see :func:`set_enabled`), while
    torch.compile traces, or when the library cannot be built or loaded (logged once)."""
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
    """Switch the kernels on or off for this process (the layers then run their torch code);
    None: follow ``envs.CPU_FUSED_OPS`` again (read at the next kernel call)."""
    global _enabled
    _enabled = enabled


def _load() -> CpuOps | None:
    return native.load_kernels(_SOURCE, CpuOps, "fused CPU kernels", "the PyTorch code")


def num_threads_for(num_elements: int) -> int:
    """Threads for a kernel over ``num_elements`` elements: torch's intra-op count, fewer for
    small work (a parallel region has a fixed cost)."""
    if num_elements < 2 * _ELEMENTS_PER_THREAD:  # a decode step's rows: no call into torch
        return 1
    return max(1, min(torch.get_num_threads(), num_elements // _ELEMENTS_PER_THREAD))


def can_run(*tensors: torch.Tensor) -> bool:
    """Whether tensors may go to a kernel: on the CPU, and not tracked by autograd (the kernels
    write in place and have no backward)."""
    if torch.is_grad_enabled():
        return all(t.is_cpu and not t.requires_grad for t in tensors)
    return all(t.is_cpu for t in tensors)
