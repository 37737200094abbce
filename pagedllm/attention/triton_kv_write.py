"""The KV write (vLLM's ``reshape_and_cache``) as one Triton kernel launch.

Each new token's key and value rows go to its slot of the paged cache
(slot = block_id × block_size + offset, see :mod:`pagedllm.attention.backend`), cast to the
cache dtype. One program per token copies its ``num_kv_heads × head_dim`` keys and values;
key/value may be strided views of the fused QKV projection (no copy to make them
contiguous). A negative slot means "padding, write nothing" (a CUDA-graph batch padded to a
captured size may carry such tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cslot, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program t: key[t], value[t] (NUM_KV_HEADS, HEAD_DIM) -> cache slot slot_mapping[t]."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    row = t.to(tl.int64)
    cache_offs = slot * stride_cslot + h[:, None] * stride_ch + d[None, :]
    k = tl.load(key_ptr + row * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + row * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Write new keys/values into the paged cache, in place (one launch).

    Args:
        key, value: (T, num_kv_heads, head_dim), last dim contiguous, any float dtype.
        kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim), contiguous; its dtype
            is the stored dtype (float32/bfloat16/float16).
        slot_mapping: (T,) int64 (or int32); a negative slot skips that token.
    Raises:
        ValueError: when key/value/cache shapes disagree or a last dim is strided.
    """
    num_tokens = key.shape[0]
    if key.shape != value.shape or tuple(key.shape[1:]) != tuple(kv_cache.shape[3:]):
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match the cache "
                         f"(num_kv_heads, head_dim)={tuple(kv_cache.shape[3:])}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("key/value need a contiguous last dim and the kv_cache must be contiguous")
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = kv_cache.shape[3:]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _kv_write_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        num_kv_heads * head_dim, head_dim,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
