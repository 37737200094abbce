"""Fused RMSNorm on CPU (:mod:`pagedllm.models.layers.norm`'s rounding), optionally after the residual add."""

from __future__ import annotations

import torch

from pagedllm.ops.calls import RmsNormCall, prepared
from pagedllm.ops import recording
from pagedllm.ops.library import can_run, cpu_ops, num_threads_for

__all__ = ["fused_add_rms_norm_", "rms_norm"]

_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor | None:
    """RMSNorm of x's rows (x: (..., dim) float32/bfloat16 on CPU, unit last stride; weight: (dim,)) into a
    new tensor; ``gemma``: the ``(1 + w)`` convention. None when the kernel does not apply."""
    ops = cpu_ops()
    rows = _rows(x) if ops is not None and _weight_fits(weight, x) else None
    if rows is None:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    num_rows, dim, stride = rows
    recording.call(ops.rms_norm[x.dtype], x.data_ptr(), None, None, weight.data_ptr(), out.data_ptr(), num_rows, dim,
                   stride, 0, dim, eps, gemma, num_threads_for(num_rows * dim), keep=(weight,),
                   task=(ops.rms_norm_task[x.dtype], recording.TEAM))
    return out


def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                        gemma: bool, x_weight: torch.Tensor | None = None) -> bool:
    """In place: ``residual += x`` (or ``cast(norm_{x_weight}(x))``), then ``x = norm_{weight}(residual)``.
    x, residual: (T, dim) of one dtype, unit last strides. False (nothing written) when the kernel does not apply."""
    ops = cpu_ops()
    if ops is None or weight is None and x_weight is None:
        return False
    rows = _rows(x)
    if rows is None or residual.dtype != x.dtype or weight is not None and not _weight_fits(weight, x) \
            or x_weight is not None and not _weight_fits(x_weight, x):
        return False
    residual_rows = _rows(residual)
    if residual_rows is None or residual_rows[:2] != rows[:2]:
        return False
    num_rows, dim, stride = rows
    call, ref = prepared(RmsNormCall, (num_rows, dim, stride, residual_rows[2], stride, eps, gemma,
                                       num_threads_for(num_rows * dim)))
    call.x = call.out = x.data_ptr()
    call.x_w = None if x_weight is None else x_weight.data_ptr()
    call.residual, call.w = residual.data_ptr(), None if weight is None else weight.data_ptr()
    recording.call_struct(ops.rms_norm_call[x.dtype], call, ref, keep=(weight, x_weight),
                          task=(ops.rms_norm_task[x.dtype], recording.TEAM))
    return True


def _rows(x: torch.Tensor) -> tuple[int, int, int] | None:
    """(num_rows, dim, row stride) of x's last axis, or None when a kernel cannot take it."""
    if x.dtype not in _DTYPES or not x.is_cpu or (x.requires_grad and torch.is_grad_enabled()):
        return None
    shape = x.shape
    if len(shape) == 2:
        stride = x.stride()
        if stride[1] == 1:
            return shape[0], shape[1], stride[0]
    if shape and shape[-1] > 0 and x.is_contiguous():
        return x.numel() // shape[-1], shape[-1], shape[-1]
    return None


def _weight_fits(weight: torch.Tensor, x: torch.Tensor) -> bool:
    return (weight.dtype == x.dtype and weight.dim() == 1 and x.dim() > 0 and weight.shape[0] == x.shape[-1]
            and weight.is_contiguous() and weight.is_cpu and not (weight.requires_grad and torch.is_grad_enabled()))
