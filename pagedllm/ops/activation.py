"""Fused gated activation on CPU: ``act(gate) * up`` in one pass, with GatedMLP's rounding points."""

from __future__ import annotations

import torch

from pagedllm.ops.calls import ActAndMulCall, prepared
from pagedllm.ops import recording
from pagedllm.ops.library import can_run, cpu_ops, num_threads_for

__all__ = ["FUSED_ACTIVATIONS", "act_and_mul"]

# transformers activation names -> the kernel's ACT_* code (the tanh GELUs: ``F.gelu(approximate="tanh")``)
FUSED_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1, "gelu_fast": 1}


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor | None:
    """``act(x[:, :I]) * x[:, I:]`` for x (T, 2I) (unit last stride) as a new (T, I) tensor, or None when
    the kernel does not apply."""
    ops = cpu_ops()
    act = FUSED_ACTIVATIONS.get(activation)
    if ops is None or act is None or x.dtype not in ops.dtypes or x.dim() != 2 or x.stride(1) != 1 \
            or x.shape[1] % 2 or not can_run(x):
        return None
    num_rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, inter, dtype=x.dtype)
    # threads weighted: exp / tanh cost several plain passes per element
    call, ref = prepared(ActAndMulCall, (num_rows, inter, x.stride(0), inter, act,
                                         num_threads_for(num_rows * inter * 4)))
    call.inp, call.out = x.data_ptr(), out.data_ptr()
    recording.call_struct(ops.act_and_mul_call[x.dtype], call, ref, task=(ops.act_and_mul_task[x.dtype], recording.TEAM))
    return out
