"""Paged attention as one Triton kernel (CUDA), testable on CPU with ``TRITON_INTERPRET=1``.

Status: a stretch backend. It is checked against :class:`TorchPagedAttention` under the
Triton interpreter on CPU; it has not yet been benchmarked on a GPU, so
:func:`~pagedllm.attention.get_attention_backend` uses it only when asked
(``PAGEDLLM_ATTENTION_BACKEND=triton``).

Design (PagedAttention, Kwon et al. 2023, with the online softmax of FlashAttention,
Dao et al. 2022): one program per (query token, KV head). It loads the ``group`` query
heads that share the KV head, walks the request's block table one KV block at a time up to
the token's own position (causal), and keeps a running max / normalizer / weighted sum in
float32. Every token's K/V are in the cache before the kernel runs (``write_kv_cache``), so
decode, prefill and chunked prefill with cached context are the same code path: a token at
position p attends keys 0..p of its request. Each K/V block is read once per query token,
which is ideal for decode and adequate for short prefills; long prefills would want
query tiles (vLLM's unified attention) — not done here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.backend import check_shapes, write_kv_cache


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, req_idx_ptr, pos_ptr, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program (t, h): query token t, KV head h -> out[t, h*GROUP:(h+1)*GROUP, :]."""
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(req_idx_ptr + t)
    pos = tl.load(pos_ptr + t)  # this token's position in its request; it sees keys 0..pos

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # (BLOCK_G, BLOCK_D)

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)  # running max of the scores
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)  # running weighted sum of V
    offs = tl.arange(0, BLOCK_SIZE)
    num_blocks = pos // BLOCK_SIZE + 1
    for j in range(0, num_blocks):
        block = tl.load(block_tables_ptr + req * stride_bt + j).to(tl.int64)
        key_mask = j * BLOCK_SIZE + offs <= pos  # causal, and the unwritten tail of the last block
        kv_offs = block * stride_cb + kv_head * stride_ch + offs[:, None] * stride_cs + d[None, :]
        kv_mask = key_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # (BLOCK_SIZE, BLOCK_D)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (BLOCK_G, BLOCK_SIZE)
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])  # (BLOCK_G, BLOCK_SIZE)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # (BLOCK_SIZE, BLOCK_D)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def token_layout(metadata: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token: its request index and its position in that request (no host sync).

    Returns (req_idx, positions), each (num_tokens,) int32 on the metadata's device.
    """
    qsl = metadata.query_start_loc.long()
    device = qsl.device
    query_lens = qsl[1:] - qsl[:-1]  # (B,)
    req_idx = torch.repeat_interleave(torch.arange(query_lens.shape[0], device=device), query_lens,
                                      output_size=num_tokens)  # (T,)
    # a request's last query token sits at position seq_len - 1
    positions = metadata.seq_lens.long()[req_idx] - qsl[1:][req_idx] + torch.arange(num_tokens, device=device)
    return req_idx.to(torch.int32), positions.to(torch.int32)


class TritonPagedAttention:
    """The :class:`~pagedllm.attention.backend.AttentionBackend` as one Triton kernel launch per layer.

    Same contract as :class:`~pagedllm.attention.torch_paged.TorchPagedAttention`:
    query (T, num_heads, head_dim), key/value (T, num_kv_heads, head_dim), kv_cache
    (2, num_blocks, block_size, num_kv_heads, head_dim) written in place; returns
    (T, num_heads, head_dim) in the query dtype. Raises ValueError on layout mismatches.
    """

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        check_shapes(query, key, kv_cache)
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        num_tokens, num_heads, head_dim = query.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
        if num_tokens == 0:
            return out
        req_idx, positions = token_layout(metadata, num_tokens)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        group = num_heads // num_kv_heads
        _paged_attention_kernel[(num_tokens, num_kv_heads)](
            query, key_cache, value_cache, out, metadata.block_tables, req_idx, positions, scale,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), metadata.block_tables.stride(0),
            GROUP=group, BLOCK_G=triton.next_power_of_2(group), HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        )
        return out

    __call__ = forward
