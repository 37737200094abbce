"""Packed hidden states -> one vector per sequence (vLLM's ``PoolingType`` names): ``MEAN`` of its
tokens, its first (``CLS``) or its last (``LAST``) token's; ``normalize``: divided by its L2 norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

POOLING_TYPES = ("MEAN", "CLS", "LAST")


@dataclass(frozen=True)
class Pooler:
    pooling_type: str = "MEAN"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    def __call__(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """hidden: (T, H) of sequences packed back to back, ``seq_lens`` summing to T -> (N, H)."""
        lens = torch.tensor(seq_lens, device=hidden.device)
        ends = lens.cumsum(0)
        if self.pooling_type == "CLS":
            pooled = hidden[ends - lens]
        elif self.pooling_type == "LAST":
            pooled = hidden[ends - 1]
        else:
            seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), lens)
            sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
            pooled = sums.index_add_(0, seq_of_token, hidden) / lens.unsqueeze(1).to(hidden.dtype)
        return F.normalize(pooled, p=2, dim=1) if self.normalize else pooled
