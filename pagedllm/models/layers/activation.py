"""Activation functions by their transformers config name (``hidden_act`` / ``hidden_activation``)."""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

# transformers' ACT2FN names -> the same function in plain torch.
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
