"""Activation functions by their transformers config name, and the gated form ``act(gate) * up``."""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from pagedllm.ops.activation import act_and_mul

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # exact (erf)
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_fast": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called ``name`` in a transformers config. Raises ValueError listing the known ones."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(sorted(_ACTIVATIONS))})") \
            from None


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` for ``gate_up`` (T, 2I) = [gate | up] -> (T, I). Raises ValueError for an unknown name."""
    out = act_and_mul(gate_up, activation)  # None: the fused kernel does not apply
    if out is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return get_activation(activation)(gate) * up
