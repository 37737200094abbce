"""Split-KV paged decode (flash-decoding; Dao, Haziza, Massa, Sizov, 2023): ``num_splits`` key ranges per
request write partials, reduced exactly as ``out = Σ exp(m_s − M) acc_s / Σ exp(m_s − M) l_s``. The launch
shape depends only on the batch size (CUDA graphs). One query token per request."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.triton_kv_dtype import kernel_view, kv_format, native_fp8
from pagedllm.attention.triton_unified import (attend_key_tiles, checked_launch, dot_precision, key_tile,
                                               upcast_for_interpreter)


@triton.jit
def _split_kv_partial_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, scale, k_scale, v_scale, softcap, window,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, KV_FORMAT: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
):
    """Program (seq, kv_head, split): the GROUP query heads of kv_head over one key range."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)

    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    row_mask = m < GROUP
    heads = kv_head * GROUP + m
    q_pos = tl.zeros((BLOCK_M,), dtype=tl.int32) + seq_len - 1
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    first_key = 0
    if USE_WINDOW:  # the query (position seq_len - 1) sees keys from seq_len - window on
        first_key = tl.maximum(seq_len - window, 0)
    first_tile = first_key // TILE_N
    end_tile = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(end_tile - first_tile, NUM_SPLITS)
    lo = first_tile + split * tiles_per_split
    hi = tl.minimum(lo + tiles_per_split, end_tile)
    m_i, l_i, acc = attend_key_tiles(
        q, q_pos, row_mask, lo, hi, first_key, seq, seq_len, kv_head, k_cache_ptr, v_cache_ptr, k_scales_ptr,
        v_scales_ptr, k_scale, v_scale, block_tables_ptr, stride_bt, stride_cb, stride_cs, stride_ch, scale, softcap,
        window, BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION, KV_FORMAT,
        NUM_KV_HEADS, NATIVE_FP8)

    # partials laid out (seq, head, split[, d]), float32
    part = (seq * NUM_HEADS + heads).to(tl.int64) * NUM_SPLITS + split
    tl.store(part_m_ptr + part, m_i, mask=row_mask)
    tl.store(part_l_ptr + part, l_i, mask=row_mask)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _split_kv_reduce_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, query_start_loc_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Program (seq, head): combine the NUM_SPLITS partials of one query head into out."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    part = (seq * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + s
    m_s = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc_s = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                    other=0.0)  # (BLOCK_S, BLOCK_D)
    m_max = tl.max(m_s, axis=0)
    weight = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_max))  # empty splits weigh nothing
    denom = tl.sum(weight * l_s, axis=0)
    out = tl.sum(weight[:, None] * acc_s, axis=0) / tl.where(denom == 0.0, 1.0, denom)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int, block_size: int,
                      target_programs: int = 256, max_splits: int = 32) -> int:
    """Splits per request so that decodes × KV heads × splits reaches about ``target_programs``, a power of
    two, at most one per key tile of the longest context."""
    tiles = -(-max_seq_len // key_tile(block_size))
    want = -(-target_programs // max(1, num_decodes * num_kv_heads))
    return max(1, min(triton.next_power_of_2(want), max_splits, triton.next_power_of_2(tiles)))


def split_kv_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    out: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, num_splits: int, scale: float,
                    sliding_window: int | None = None, logit_soft_cap: float | None = None,
                    kv_scales: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Decode attention with the keys split ``num_splits`` ways, arguments as
    :func:`~pagedllm.attention.triton_unified.unified_attention`; scratch B x num_heads x num_splits x
    (head_dim + 2) float32. Raises ValueError for a bad head grouping, ``num_splits < 1``, option or ``kv_scales``."""
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    group, k_scales, v_scales = checked_launch(query, key_cache, sliding_window, logit_soft_cap, kv_scales)
    num_decodes = seq_lens.shape[0]
    if num_decodes == 0:
        return
    part_acc = torch.empty(num_decodes, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    part_m = torch.empty(num_decodes, num_heads, num_splits, dtype=torch.float32, device=query.device)
    part_l = torch.empty_like(part_m)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    _split_kv_partial_kernel[(num_decodes, num_kv_heads, num_splits)](
        query, kernel_view(key_cache), kernel_view(value_cache), k_scales, v_scales, part_acc, part_m, part_l,
        block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale, float(logit_soft_cap or 0.0),
        int(sliding_window or 0),
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_M=max(16, triton.next_power_of_2(group)), TILE_N=key_tile(block_size),
        USE_SOFTCAP=logit_soft_cap is not None, USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=dot_precision(query.dtype), UPCAST=upcast_for_interpreter(query.dtype),
        KV_FORMAT=kv_format(key_cache.dtype), NUM_KV_HEADS=num_kv_heads, NATIVE_FP8=native_fp8(key_cache),
    )
    _split_kv_reduce_kernel[(num_decodes, num_heads)](
        part_acc, part_m, part_l, out, query_start_loc, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(num_splits),
    )
