"""The gated feed-forward block every dense family uses: ``down(act(gate(x)) * up(x))``.

SwiGLU with ``silu`` (Shazeer, 2020, "GLU Variants Improve Transformer"), GeGLU with
``gelu_pytorch_tanh`` (Gemma). gate and up are one fused matmul (``gate_up_proj``, as
Phi-3 checkpoints store it; others store ``gate_proj`` and ``up_proj``, which the loader
writes into the two halves). On CPU the activation and the product run as one fused kernel
(:mod:`pagedllm.ops.activation`) over the gate/up output.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.layers.activation import get_activation
from pagedllm.models.layers.tensor_parallel import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.ops.activation import act_and_mul


class GatedMLP(nn.Module):
    """x: (T, hidden) -> (T, hidden). Raises ValueError for an unknown activation name.

    With tensor parallelism gate/up are column-parallel (each rank its slice of the
    intermediate features) and down is row-parallel (one all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False) -> None:
        super().__init__()
        self.act = get_activation(activation)
        self.activation = activation
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * intermediate)
        hidden = act_and_mul(gate_up, self.activation)  # (T, intermediate); None: the fused kernel does not apply
        if hidden is None:
            gate, up = gate_up.chunk(2, dim=-1)  # each (T, intermediate)
            hidden = self.act(gate) * up
        return self.down_proj(hidden)
