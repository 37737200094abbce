"""Integers packed into int32 words, lowest bits first, as GPTQ, AWQ and compressed-tensors store them.

Element ``j`` of a word holds bits ``[bits * j, bits * (j + 1))`` (bits 4 or 8: 8 or 4 per word).
Shifts and masks, not byte views, so the result does not depend on the host's byte order.
"""

from __future__ import annotations

import torch


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """packed int32 (R, C) → unsigned values int32, (R * 32 / bits, C) for ``dim=0`` or (R, C * 32 / bits)
    for ``dim=1``: the words' elements laid out along ``dim`` in order."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed integers must be int32, got {packed.dtype}")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    mask = (1 << bits) - 1
    if dim == 0:
        values = (packed.unsqueeze(1) >> shifts.view(1, per_word, 1)) & mask  # (R, per_word, C)
        return values.reshape(packed.shape[0] * per_word, packed.shape[1])
    values = (packed.unsqueeze(2) >> shifts.view(1, 1, per_word)) & mask  # (R, C, per_word)
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)
