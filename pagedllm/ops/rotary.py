"""Fused neox rotary embedding of the q and k heads on CPU, optionally after the per-head q/k RMSNorm, with
:class:`~pagedllm.models.layers.attention.SelfAttention`'s rounding points.
"""

from __future__ import annotations

import torch

from pagedllm.ops.calls import RopeQkCall, prepared
from pagedllm.ops import recording
from pagedllm.ops.library import can_run, cpu_ops, num_threads_for

__all__ = ["rope_qk"]

_NORM_NONE, _NORM_RMS, _NORM_GEMMA = 0, 1, 2


def rope_qk(qkv: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
            q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0,
            gemma: bool = False) -> torch.Tensor | None:
    """Rotate the q and k heads of ``qkv`` ((T, (num_heads + 2 * num_kv_heads) * head_dim), unit last stride):
    k in place, q returned as a new (T, num_heads, head_dim) tensor. ``cos_sin``: (T, 2, rotary_dim).
    ``q_weight``/``k_weight``: both or neither, a per-head RMSNorm first. None when the kernel does not apply."""
    ops = cpu_ops()
    if ops is None or qkv.dtype not in ops.dtypes or qkv.dim() != 2 or qkv.stride(1) != 1 \
            or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or not 0 < head_dim <= ops.max_head_dim \
            or not _table_fits(cos_sin, qkv, head_dim) or not can_run(qkv, cos_sin):
        return None
    norm_kind = _NORM_NONE
    if q_weight is not None or k_weight is not None:
        if not all(w is not None and w.dtype == qkv.dtype and w.is_contiguous() and w.shape == (head_dim,)
                   and can_run(w) for w in (q_weight, k_weight)):
            return None
        norm_kind = _NORM_GEMMA if gemma else _NORM_RMS
    num_tokens = qkv.shape[0]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype)
    call, ref = prepared(RopeQkCall, (qkv.stride(0), num_heads * head_dim, cos_sin.stride(0), num_tokens, num_heads,
                                      num_kv_heads, head_dim, cos_sin.shape[2], eps, norm_kind,
                                      num_threads_for(num_tokens * (num_heads + num_kv_heads) * head_dim * 2)))
    call.qkv, call.q_out, call.cos_sin = qkv.data_ptr(), q.data_ptr(), cos_sin.data_ptr()
    call.q_weight = q_weight.data_ptr() if norm_kind else None
    call.k_weight = k_weight.data_ptr() if norm_kind else None
    recording.call_struct(ops.rope_qk_call[qkv.dtype], call, ref, keep=(q_weight, k_weight),
                          task=(ops.rope_qk_task[qkv.dtype], recording.TEAM))
    return q


def _table_fits(cos_sin: torch.Tensor, qkv: torch.Tensor, head_dim: int) -> bool:
    return (cos_sin.dtype == qkv.dtype and cos_sin.dim() == 3 and cos_sin.shape[0] == qkv.shape[0]
            and cos_sin.shape[1] == 2 and cos_sin.shape[2] % 2 == 0 and 0 < cos_sin.shape[2] <= head_dim
            and cos_sin.stride(2) == 1 and cos_sin.stride(1) == cos_sin.shape[2])
