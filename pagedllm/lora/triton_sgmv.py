"""The grouped LoRA matmul as two Triton kernels over the step's segments (runs of rows under one
slot; base-model rows are in none): shrink ``h = x @ A_s^T`` (float32), then expand
``out += h @ B_s^T`` in place. Segments own disjoint rows, so programs never write the same row.
Tested under ``TRITON_INTERPRET=1`` on the CPU (tests/lora/test_triton_sgmv.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.lora.layer import LoRASegments

BLOCK_M = 16
BLOCK_K = 32
BLOCK_N = 64


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, starts_ptr, lengths_ptr, slots_ptr, in_features, rank,
                   stride_xm, stride_as, stride_ak, stride_hm,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    seg = tl.program_id(0)
    tile = tl.program_id(1)
    start = tl.load(starts_ptr + seg)
    length = tl.load(lengths_ptr + seg)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    if tile * BLOCK_M >= length:
        return
    rows = (start + offs_m).to(tl.int64)
    row_mask = offs_m < length
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=row_mask[:, None] & (offs_k[None, :] < in_features), other=0.0)
        a = tl.load(a_ptr + slot * stride_as + offs_k[:, None] * stride_ak + offs_r[None, :],
                    mask=(offs_k[:, None] < in_features) & (offs_r[None, :] < rank), other=0.0)
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
    tl.store(h_ptr + rows[:, None] * stride_hm + offs_r[None, :], acc,
             mask=row_mask[:, None] & (offs_r[None, :] < rank))


@triton.jit
def _expand_kernel(h_ptr, b_ptr, out_ptr, starts_ptr, lengths_ptr, slots_ptr, out_features, rank,
                   stride_hm, stride_bs, stride_br, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    seg = tl.program_id(0)
    tile = tl.program_id(1)
    col_tile = tl.program_id(2)
    start = tl.load(starts_ptr + seg)
    length = tl.load(lengths_ptr + seg)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    if tile * BLOCK_M >= length:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = (start + offs_m).to(tl.int64)
    row_mask = offs_m < length
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.load(h_ptr + rows[:, None] * stride_hm + offs_r[None, :],
                mask=row_mask[:, None] & (offs_r[None, :] < rank), other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
                mask=(offs_r[:, None] < rank) & (offs_n[None, :] < out_features), other=0.0)
    acc = tl.dot(h, b.to(tl.float32))
    out_mask = row_mask[:, None] & (offs_n[None, :] < out_features)
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    current = tl.load(out_ptrs, mask=out_mask, other=0.0)
    tl.store(out_ptrs, (current.to(tl.float32) + acc).to(current.dtype), mask=out_mask)


def sgmv_add(x: torch.Tensor, out: torch.Tensor, lora_a_t: torch.Tensor, lora_b_t: torch.Tensor,
             segments: LoRASegments) -> torch.Tensor:
    """``out`` (T, out) += per segment ``(x[rows] @ lora_a_t[slot]) @ lora_b_t[slot]``, in place.
    x (T, in) contiguous rows; lora_a_t (slots, in, R), lora_b_t (slots, R, out) contiguous."""
    num_tokens, in_features = x.shape
    rank, out_features = lora_b_t.shape[1], lora_b_t.shape[2]
    x = x.contiguous()
    h = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(rank))
    num_segments = segments.starts.shape[0]
    m_tiles = triton.cdiv(segments.max_length, BLOCK_M)
    _shrink_kernel[(num_segments, m_tiles)](
        x, lora_a_t, h, segments.starts, segments.lengths, segments.slots, in_features, rank,
        x.stride(0), lora_a_t.stride(0), lora_a_t.stride(1), h.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=block_r)
    _expand_kernel[(num_segments, m_tiles, triton.cdiv(out_features, BLOCK_N))](
        h, lora_b_t, out, segments.starts, segments.lengths, segments.slots, out_features, rank,
        h.stride(0), lora_b_t.stride(0), lora_b_t.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=block_r)
    return out
