"""Unified varlen paged attention: one Triton launch for a whole ragged batch. FlashAttention-2's tiling and
online softmax (Dao, 2023) in the layout of vLLM's ``kernel_unified_attention_2d``: a program owns
``BLOCK_Q`` query tokens of one request x one KV head, walks its keys in ``TILE_N`` tiles through the block
table, m, l, acc in float32. The grid depends only on host sizes (CUDA graphs)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedllm.attention.triton_kv_dtype import check_kv_scales, kernel_view, kv_codes, kv_format, native_fp8


@triton.jit
def find_seq_idx(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The request that owns program ``tile``: the largest b with qsl[b] // BLOCK_Q + b <= tile."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(query_start_loc_ptr + mid)
        if start // BLOCK_Q + mid <= tile:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def soft_cap(scores, cap):
    """``cap * tanh(scores / cap)`` in float32 (tanh via exp: tl has no portable tanh)."""
    x = scores / cap
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


@triton.jit
def attend_key_tile(q, q_pos, row_mask, m_i, l_i, acc, j, first_key, seq, seq_len, kv_head, k_cache_ptr,
                    v_cache_ptr, k_scales_ptr, v_scales_ptr, k_scale, v_scale, block_tables_ptr, stride_bt, stride_cb,
                    stride_cs, stride_ch, scale, softcap, window,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    TILE_N: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, KV_FORMAT: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                    NATIVE_FP8: tl.constexpr):
    """One online-softmax step of request ``seq`` over key tile j: q (BLOCK_M, BLOCK_D); m_i, l_i (BLOCK_M,),
    acc (BLOCK_M, BLOCK_D) float32 -> updated (m_i, l_i, acc). Keys before ``first_key`` are never read."""
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    key_pos = j * TILE_N + tl.arange(0, TILE_N)
    key_mask = (key_pos < seq_len) & (key_pos >= first_key)
    blocks = tl.load(block_tables_ptr + seq * stride_bt + key_pos // BLOCK_SIZE, mask=key_mask,
                     other=0).to(tl.int64)
    kv_offs = blocks * stride_cb + (key_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    # keys past seq_len are masked on load too: their slots may hold NaN (0 x NaN is NaN)
    k = tl.load(k_cache_ptr + kv_offs[None, :] + d[:, None],
                mask=key_mask[None, :] & d_mask[:, None], other=0)  # (BLOCK_D, TILE_N)
    v = tl.load(v_cache_ptr + kv_offs[:, None] + d[None, :],
                mask=key_mask[:, None] & d_mask[None, :], other=0)  # (TILE_N, BLOCK_D)
    k = kv_codes(k, q.dtype, KV_FORMAT, NATIVE_FP8)
    v = kv_codes(v, q.dtype, KV_FORMAT, NATIVE_FP8)
    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # (BLOCK_M, TILE_N) float32
    if KV_FORMAT == 3:
        scale_offs = (blocks * BLOCK_SIZE + key_pos % BLOCK_SIZE) * NUM_KV_HEADS + kv_head
        scores = scores * tl.load(k_scales_ptr + scale_offs, mask=key_mask, other=0.0)[None, :]
        v_scales = tl.load(v_scales_ptr + scale_offs, mask=key_mask, other=0.0)
    elif KV_FORMAT != 0:
        scores = scores * k_scale
    if USE_SOFTCAP:
        scores = soft_cap(scores, softcap)
    visible = key_pos[None, :] <= q_pos[:, None]  # causal, with the context offset
    if USE_WINDOW:
        visible = visible & (q_pos[:, None] - key_pos[None, :] < window)
    scores = tl.where(visible & row_mask[:, None], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # a row that has seen no key yet keeps m = -inf: shift by 0 so exp() gives 0, not NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])  # (BLOCK_M, TILE_N)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KV_FORMAT == 3:
        p = p * v_scales[None, :]
    elif KV_FORMAT != 0:
        p = p * v_scale
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def attend_key_tiles(q, q_pos, row_mask, lo, hi, first_key, seq, seq_len, kv_head, k_cache_ptr, v_cache_ptr,
                     k_scales_ptr, v_scales_ptr, k_scale, v_scale, block_tables_ptr, stride_bt, stride_cb, stride_cs,
                     stride_ch, scale, softcap, window,
                     BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     TILE_N: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, KV_FORMAT: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                     NATIVE_FP8: tl.constexpr):
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for j in range(lo, hi):
        m_i, l_i, acc = attend_key_tile(
            q, q_pos, row_mask, m_i, l_i, acc, j, first_key, seq, seq_len, kv_head, k_cache_ptr,
            v_cache_ptr, k_scales_ptr, v_scales_ptr, k_scale, v_scale, block_tables_ptr, stride_bt, stride_cb,
            stride_cs, stride_ch, scale, softcap, window,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION, KV_FORMAT, NUM_KV_HEADS,
            NATIVE_FP8)
    return m_i, l_i, acc


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, scale, k_scale, v_scale, softcap, window, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, KV_FORMAT: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
):
    """Program (tile, kv_head): BLOCK_Q query tokens of one request x the GROUP query heads of kv_head."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = find_seq_idx(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_in_seq = tile - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_idx = tile_in_seq * BLOCK_Q + m // GROUP
    heads = kv_head * GROUP + m % GROUP
    row_mask = (m // GROUP < BLOCK_Q) & (q_idx < query_len)
    q_pos = context_len + q_idx  # (BLOCK_M,) position of each row's token in its request
    rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)

    last_pos = context_len + tl.minimum((tile_in_seq + 1) * BLOCK_Q, query_len) - 1  # the tile's last query
    first_key = 0
    if USE_WINDOW:  # the tile's first query sees keys from first_pos - window + 1 on
        first_key = tl.maximum(context_len + tile_in_seq * BLOCK_Q - window + 1, 0)
    lo = first_key // TILE_N
    hi = tl.cdiv(last_pos + 1, TILE_N)
    m_i, l_i, acc = attend_key_tiles(
        q, q_pos, row_mask, lo, hi, first_key, seq, seq_len, kv_head, k_cache_ptr, v_cache_ptr, k_scales_ptr,
        v_scales_ptr, k_scale, v_scale, block_tables_ptr, stride_bt, stride_cb, stride_cs, stride_ch, scale, softcap,
        window, BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION, KV_FORMAT,
        NUM_KV_HEADS, NATIVE_FP8)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def tile_shape(group: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows per program (>= 16) and query tokens per tile: one for decode-only batches."""
    rows = max(16, triton.next_power_of_2(group))
    if max_query_len > 1:
        rows = max(64, rows)
    return rows, max(1, rows // group)


def key_tile(block_size: int) -> int:
    """Keys per inner-loop step (vLLM's unified kernel uses 32 too); each key finds its block."""
    return 32


def upcast_for_interpreter(dtype: torch.dtype) -> bool:
    """``tl.dot`` in float32 only for bfloat16 under ``TRITON_INTERPRET=1`` (numpy reads bfloat16 as integers)."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs multiply in full precision (``ieee``), not TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def unified_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      out: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                      sliding_window: int | None = None, logit_soft_cap: float | None = None,
                      kv_scales: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Causal paged attention of a flat ragged batch into ``out`` (one launch): query, out (T, num_heads,
    head_dim), last dim contiguous; caches (num_blocks, block_size, num_kv_heads, head_dim) already holding
    this step's tokens; kv_scales: an int8 cache's (2, num_blocks, block_size, num_kv_heads) float32.
    Raises ValueError for a bad head grouping, a non-positive window or cap, or ``kv_scales`` that do not fit."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group, k_scales, v_scales = checked_launch(query, key_cache, sliding_window, logit_soft_cap, kv_scales)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return
    block_m, block_q = tile_shape(group, max_query_len)
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _unified_attention_kernel[grid](
        query, kernel_view(key_cache), kernel_view(value_cache), k_scales, v_scales, out, block_tables, seq_lens,
        query_start_loc, scale, k_scale, v_scale, float(logit_soft_cap or 0.0), int(sliding_window or 0), num_reqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=key_tile(block_size), USE_SOFTCAP=logit_soft_cap is not None,
        USE_WINDOW=sliding_window is not None, DOT_PRECISION=dot_precision(query.dtype),
        UPCAST=upcast_for_interpreter(query.dtype), KV_FORMAT=kv_format(key_cache.dtype), NUM_KV_HEADS=num_kv_heads,
        NATIVE_FP8=native_fp8(key_cache),
    )


def checked_launch(query: torch.Tensor, key_cache: torch.Tensor, sliding_window: int | None,
                   logit_soft_cap: float | None, kv_scales: torch.Tensor | None
                   ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(query heads per KV head, key scales, value scales) of a launch; raises as :func:`unified_attention`."""
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    _check_options(sliding_window, logit_soft_cap)
    return (num_heads // num_kv_heads, *scale_pointers(key_cache, kv_scales))


def scale_pointers(key_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's key and value scale tensors (the key cache as a never-read placeholder
    otherwise). Raises ValueError when ``kv_scales`` does not fit."""
    check_kv_scales(key_cache.unsqueeze(0).expand(2, *key_cache.shape), kv_scales)
    if kv_scales is None:
        return key_cache, key_cache
    return kv_scales[0], kv_scales[1]


def _check_options(sliding_window: int | None, logit_soft_cap: float | None) -> None:
    """ValueError naming the option when it is given but not positive."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
    if logit_soft_cap is not None and not logit_soft_cap > 0:
        raise ValueError(f"logit_soft_cap must be positive, got {logit_soft_cap}")
