"""The gated feed-forward block: ``down(act(gate(x)) * up(x))`` (SwiGLU, Shazeer 2020; GeGLU for
Gemma), gate and up one fused matmul (``gate_up_proj``)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.layers.activation import gated_activation, get_activation
from pagedllm.models.layers.tensor_parallel import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """x (T, hidden) -> (T, hidden). Raises ValueError for an unknown activation name."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False) -> None:
        super().__init__()
        self.act = get_activation(activation)
        self.activation = activation
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(gated_activation(self.gate_up_proj.forward(x), self.activation))
