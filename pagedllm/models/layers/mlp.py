"""The gated feed-forward block every dense family uses: ``down(act(gate(x)) * up(x))``.

SwiGLU with ``silu`` (Shazeer, 2020, "GLU Variants Improve Transformer"), GeGLU with
``gelu_pytorch_tanh`` (Gemma). gate and up are one fused matmul (``gate_up_proj``, as
Phi-3 checkpoints store it; others store ``gate_proj`` and ``up_proj``, which the loader
writes into the two halves). On CPU the activation and the product run as one fused kernel
(:func:`~pagedllm.models.layers.activation.gated_activation`) over the gate/up output.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.layers.activation import gated_activation, get_activation
from pagedllm.models.layers.tensor_parallel import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """x: (T, hidden) -> (T, hidden). Raises ValueError for an unknown activation name.

    With tensor parallelism gate/up are column-parallel (each rank its slice of the
    intermediate features) and down is row-parallel (one all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False) -> None:
        super().__init__()
        self.act = get_activation(activation)  # validates the name
        self.activation = activation
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # sub-modules through forward: no nn.Module hook dispatch per layer and step
        return self.down_proj.forward(gated_activation(self.gate_up_proj.forward(x), self.activation))  # via (T, I)
