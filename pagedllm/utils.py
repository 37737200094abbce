"""Small arithmetic shared across layers (no torch: the core imports it)."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def cdiv(a: T, b: int) -> T:
    """Ceiling of ``a / b`` for positive ``b``, elementwise on integer arrays and tensors too."""
    return -(-a // b)  # type: ignore[operator]
