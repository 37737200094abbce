"""The self-attention block of a decoder layer: fused q/k/v projection, optional per-head q/k norm, rotary
embedding, paged attention, output projection (on CPU q/k norm and rotation are one kernel,
:mod:`pagedllm.ops.rotary`)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pagedllm.attention import Attention, AttentionBackend
from pagedllm.distributed.parallel_state import heads_per_rank
from pagedllm.models.layers.tensor_parallel import QKVParallelLinear, RowParallelLinear
from pagedllm.models.layers.rotary import RotaryEmbedding
from pagedllm.ops.rotary import rope_qk


class SelfAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache; shapes are this rank's heads under tensor
    parallelism. ``qk_norm``: ``cls(head_dim, eps)`` per head of q and k before the rotation, or None;
    ``rope_key``: which of the model's rotary tables this layer uses (Gemma 3: per layer type)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 backend: AttentionBackend, *, scale: float | None = None, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm: Callable[[int, float], nn.Module] | None = None,
                 qk_norm_eps: float = 1e-6, sliding_window: int | None = None,
                 logit_soft_cap: float | None = None, rope_key: str = "default") -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(hidden_size, num_heads, num_kv_heads, head_dim, bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=o_bias)
        num_heads, num_kv_heads = heads_per_rank(num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.rope_key = rope_key
        self.q_norm = qk_norm(head_dim, qk_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(head_dim, qk_norm_eps) if qk_norm else None
        self.attn = Attention(num_heads, num_kv_heads, head_dim, head_dim**-0.5 if scale is None else scale, backend,
                              sliding_window=sliding_window, logit_soft_cap=logit_soft_cap)

    def forward(self, hidden: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """hidden (T, hidden), cos_sin (T, 2, rotary_dim) -> (T, hidden)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)
        q, k, v = self._rotated_q_k_v(qkv, cos_sin)
        out = self.attn.forward(q, k, v)
        return self.o_proj.forward(out.reshape(num_tokens, self.q_size))

    def _rotated_q_k_v(self, qkv: torch.Tensor, cos_sin: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (T, heads, head_dim), k and v (T, kv_heads, head_dim), q and k normed and rotated."""
        num_tokens = qkv.shape[0]
        norm = self.q_norm
        q = rope_qk(qkv, cos_sin, self.num_heads, self.num_kv_heads, self.head_dim,
                    None if norm is None else norm.weight, None if norm is None else self.k_norm.weight,
                    0.0 if norm is None else norm.eps, norm is not None and norm.gemma_convention)
        heads = qkv.view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if q is not None:  # the fused kernel rotated k in place in qkv
            _, k, v = heads.split_with_sizes([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
            return q, k, v
        q, k = self._rotated_q_k_torch(qkv, cos_sin)
        return q, k, heads[:, self.num_heads + self.num_kv_heads:]  # v: (T, kv_heads, hd)

    def _rotated_q_k_torch(self, qkv: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch code of the fused kernel: q and k normed and rotated, new tensors (qkv unchanged)."""
        num_tokens = qkv.shape[0]
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                        self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        qk = RotaryEmbedding.apply(qk, cos_sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # (T, heads, hd), (T, kv_heads, hd)
        return q, k
