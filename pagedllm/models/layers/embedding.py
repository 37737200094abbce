"""Token embedding (optionally scaled, as Gemma's) and the output head (optionally soft-capped)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers.linear import Linear
from pagedllm.ops import skinny_gemm


class VocabEmbedding(nn.Embedding):
    """ids (T,) int64 -> (T, hidden); with ``scale`` (Gemma: sqrt(hidden_size) rounded to the dtype, as
    transformers does) rows are multiplied by it in the model dtype. After :meth:`use_lookup` the rows come from
    another format's storage (a quantized tied head's) and the float weight is gone."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None) -> None:
        super().__init__(vocab_size, hidden_size)
        self.scale = scale
        self.lookup: Callable[[torch.Tensor], torch.Tensor] | None = None

    def use_lookup(self, lookup: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``lookup(ids)`` (T, hidden) in the weight's dtype, the same rows as the weight's: the weight is
        dropped."""
        self.lookup = lookup
        self.weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(input_ids, self.weight) if self.lookup is None else self.lookup(input_ids)
        if self.scale is not None:
            out = out * torch.tensor(self.scale, dtype=out.dtype)
        return out


class LMHead(Linear):
    """hidden (N, hidden) -> logits (N, vocab) float32. ``soft_cap`` c: ``c * tanh(logits / c)`` in the model dtype."""

    # its rows are the sampled ones: no oneDNN copy of the (vocab x hidden) weight
    onednn_for_many_rows = False

    def __init__(self, hidden_size: int, vocab_size: int, soft_cap: float | None = None) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)
        self.soft_cap = soft_cap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        skinny = self.skinny_for(hidden) if self.soft_cap is None else None
        if skinny is not None and skinny_gemm.supports_float32_out(skinny):
            # float32 sums: rounded to bfloat16, logits within 1/128 of each other would tie
            return skinny_gemm.skinny_linear(hidden, skinny, float32_out=True)
        logits = super().forward(hidden)
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits.float()
