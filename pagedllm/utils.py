"""Small helpers shared across floors (no torch at import: the core imports this module)."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def cdiv(a: T, b: int) -> T:
    """Ceiling of ``a / b`` for positive ``b``, elementwise on integer arrays and tensors too."""
    return -(-a // b)  # type: ignore[operator]


def resolve_device(name: str):
    """The ``torch.device`` for ``EngineConfig.device``: ``auto`` → cuda when available, else cpu.
    Raises ValueError for cuda without a GPU."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use device='cpu'")
    return torch.device(name)
