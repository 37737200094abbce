"""RMSNorm (Zhang & Sennrich, 2019): :class:`RMSNorm` casts to the model dtype before the weight
(transformers' LlamaRMSNorm), :class:`GemmaRMSNorm` computes ``normalize(x) * (1 + w)`` in float32.
``forward(x, residual)`` returns ``(normed, x + residual)``; on CPU one fused kernel, in place."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.ops.norm import fused_add_rms_norm_, rms_norm


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last axis, statistics in float32."""

    gemma_convention = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            out = rms_norm(x, self.weight, self.eps, self.gemma_convention)  # None: the kernel does not apply
            return out if out is not None else self._norm(x)
        if fused_add_rms_norm_(x, residual, self.weight, self.eps, self.gemma_convention):
            return x, residual
        x = x + residual
        return self._norm(x), x

    def add_normed(self, x: torch.Tensor, residual: torch.Tensor,
                   next_norm: "RMSNorm | None" = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(next_norm(residual + self(x)) or None, residual + self(x))``, x and residual (T, dim): Gemma's
        post-norm."""
        same = next_norm is None or (next_norm.gemma_convention == self.gemma_convention and next_norm.eps == self.eps)
        if same and fused_add_rms_norm_(x, residual, None if next_norm is None else next_norm.weight, self.eps,
                                        self.gemma_convention, x_weight=self.weight):
            return (None if next_norm is None else x), residual
        residual = residual + self(x)
        return (None if next_norm is None else next_norm(residual)), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class GemmaRMSNorm(RMSNorm):
    """``x / sqrt(mean(x**2) + eps) * (1 + weight)``, all in float32, cast to x's dtype at the end."""

    gemma_convention = True

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)
