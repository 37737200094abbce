"""Plain references the kernels are checked against."""

from __future__ import annotations

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float,
                     window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
    """Float64 causal attention; q: (Q, H, D) at positions context_len..; k, v: (S, KV, D) → (Q, H, D).

    Grouped-query heads by repeating KV heads. With a window W the query at p sees keys p - W < k <= p;
    a soft cap c makes scores c * tanh(s / c) (transformers' Gemma 2 / 3 masks and capping).
    """
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # (S, H, D)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = torch.arange(context_len, context_len + q.shape[0]).unsqueeze(1)
    k_pos = torch.arange(k.shape[0]).unsqueeze(0)
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)
