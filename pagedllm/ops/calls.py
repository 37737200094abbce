"""The fused CPU kernels' arguments as one struct each (``native/cpu_ops.c``'s ``<name>_call``), per kernel
and thread, its scalars rewritten only when they change: ctypes converts each loose argument per call.
"""

from __future__ import annotations

import ctypes
import threading

__all__ = ["ActAndMulCall", "RmsNormCall", "RopeQkCall", "prepared"]

_p, _i, _ssize, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_ssize_t, ctypes.c_float


class RmsNormCall(ctypes.Structure):
    """``struct rms_norm_call``: the arguments of ``rms_norm_<dtype>`` in order."""

    _fields_ = [("x", _p), ("x_w", _p), ("residual", _p), ("w", _p), ("out", _p), ("num_rows", _i), ("dim", _i),
                ("x_stride", _ssize), ("residual_stride", _ssize), ("out_stride", _ssize), ("eps", _f),
                ("gemma", _i), ("num_threads", _i)]
    scalars = ("num_rows", "dim", "x_stride", "residual_stride", "out_stride", "eps", "gemma", "num_threads")


class ActAndMulCall(ctypes.Structure):
    """``struct act_and_mul_call``: the arguments of ``act_and_mul_<dtype>`` in order."""

    _fields_ = [("inp", _p), ("out", _p), ("num_rows", _i), ("inter", _i), ("in_stride", _ssize),
                ("out_stride", _ssize), ("act", _i), ("num_threads", _i)]
    scalars = ("num_rows", "inter", "in_stride", "out_stride", "act", "num_threads")


class RopeQkCall(ctypes.Structure):
    """``struct rope_qk_call``: the arguments of ``rope_qk_<dtype>`` in order."""

    _fields_ = [("qkv", _p), ("qkv_stride", _ssize), ("q_out", _p), ("q_out_stride", _ssize), ("cos_sin", _p),
                ("cos_sin_stride", _ssize), ("num_tokens", _i), ("num_heads", _i), ("num_kv_heads", _i),
                ("head_dim", _i), ("rotary_dim", _i), ("q_weight", _p), ("k_weight", _p), ("eps", _f),
                ("norm_kind", _i), ("num_threads", _i)]
    scalars = ("qkv_stride", "q_out_stride", "cos_sin_stride", "num_tokens", "num_heads", "num_kv_heads",
               "head_dim", "rotary_dim", "eps", "norm_kind", "num_threads")


class _Calls(threading.local):
    """Per thread (two threads may run kernels at once): struct type -> (scalars, struct, pointer)."""

    def __init__(self) -> None:
        self.slots: dict[type, tuple[tuple, ctypes.Structure, object]] = {}


_calls = _Calls()


def prepared(struct_type: type, scalars: tuple) -> tuple[ctypes.Structure, object]:
    """This thread's struct of ``struct_type`` with its scalar fields equal to ``scalars``, and a pointer to
    pass; the caller sets the pointer fields and calls the kernel before another call of the same type."""
    slot = _calls.slots.get(struct_type)
    if slot is None or slot[0] != scalars:
        struct = struct_type(**dict(zip(struct_type.scalars, scalars)))
        slot = _calls.slots[struct_type] = (scalars, struct, ctypes.byref(struct))
    return slot[1], slot[2]
