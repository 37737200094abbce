"""The KV write (vLLM's ``reshape_and_cache``) as one Triton launch, one program per token, cast or
quantized. A negative slot (CUDA-graph padding) writes nothing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.triton_kv_dtype import (check_kv_scales, encode_fp8, kernel_view, kv_format,
                                                quantize_int8_rows)


@triton.jit
def _store_row(x, cache_ptr, scales_ptr, cache_offs, scale_offs, mask, head_mask, tensor_scale,
               KV_FORMAT: tl.constexpr):
    """One token's (BLOCK_H, BLOCK_D) keys or values into the cache, in its format."""
    if KV_FORMAT == 0:
        tl.store(cache_ptr + cache_offs, x.to(cache_ptr.dtype.element_ty), mask=mask)
    elif KV_FORMAT == 3:
        codes, scales = quantize_int8_rows(tl.where(mask, x.to(tl.float32), 0.0))
        tl.store(cache_ptr + cache_offs, codes, mask=mask)
        tl.store(scales_ptr + scale_offs, scales, mask=head_mask)
    else:
        tl.store(cache_ptr + cache_offs, encode_fp8(tl.math.div_rn(x.to(tl.float32), tensor_scale), KV_FORMAT), mask=mask)


@triton.jit
def _kv_write_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cslot, stride_ch, k_scale, v_scale,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    """Program t: key[t], value[t] (NUM_KV_HEADS, HEAD_DIM) -> slot slot_mapping[t] (int8 scales at [slot, head])."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    head_mask = h < NUM_KV_HEADS
    mask = head_mask[:, None] & (d < HEAD_DIM)[None, :]
    row = t.to(tl.int64)
    cache_offs = slot * stride_cslot + h[:, None] * stride_ch + d[None, :]
    scale_offs = slot * NUM_KV_HEADS + h
    k = tl.load(key_ptr + row * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    _store_row(k, k_cache_ptr, k_scales_ptr, cache_offs, scale_offs, mask, head_mask, k_scale, KV_FORMAT)
    v = tl.load(value_ptr + row * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    _store_row(v, v_cache_ptr, v_scales_ptr, cache_offs, scale_offs, mask, head_mask, v_scale, KV_FORMAT)


def write_kv_cache_triton(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """key, value (T, num_kv_heads, head_dim), last dim contiguous, into ``kv_cache`` at ``slot_mapping`` (T,),
    fp8 codes ``value / k_scale``. Raises ValueError for mismatched shapes, a strided last dim, or ``kv_scales``
    on the wrong cache."""
    num_tokens = key.shape[0]
    if key.shape != value.shape or tuple(key.shape[1:]) != tuple(kv_cache.shape[3:]):
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match the cache "
                         f"(num_kv_heads, head_dim)={tuple(kv_cache.shape[3:])}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("key/value need a contiguous last dim and the kv_cache must be contiguous")
    check_kv_scales(kv_cache, kv_scales)
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = kv_cache.shape[3:]
    cache = kernel_view(kv_cache)
    scales = kv_scales if kv_scales is not None else cache  # a placeholder pointer, never touched
    _kv_write_kernel[(num_tokens,)](
        key, value, cache[0], cache[1], scales[0], scales[1], slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        num_kv_heads * head_dim, head_dim, k_scale, v_scale,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FORMAT=kv_format(kv_cache.dtype),
    )
