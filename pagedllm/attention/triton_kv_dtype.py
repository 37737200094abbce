"""float8 and int8 KV codes in the Triton kernels, bit for bit :mod:`pagedllm.quantization.kv_cache`'s:
float8 e4m3fn/e5m2 (per-tensor scales, saturating, nearest even) encoded with integer arithmetic on uint8
views (Giesen's float-to-half rounding; native float8 needs compute capability 8.9+); int8 with a float32
scale per token and KV head in ``kv_scales[2, num_blocks, block_size, num_kv_heads]``."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

KV_FLOAT, KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8 = 0, 1, 2, 3


def kv_format(dtype: torch.dtype) -> int:
    """The kernels' KV_FORMAT for a cache of ``dtype`` (float32/bfloat16/float16 are KV_FLOAT)."""
    return {torch.float8_e4m3fn: KV_FP8_E4M3, torch.float8_e5m2: KV_FP8_E5M2, torch.int8: KV_INT8}.get(dtype,
                                                                                                       KV_FLOAT)


def native_fp8(cache: torch.Tensor) -> bool:
    """Whether kernels decode float8 with the GPU's conversion (compute capability 8.9+, no interpreter)."""
    return (cache.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(cache.device) >= (8, 9))


def kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel gets for ``cache``: a uint8 view of a float8 one."""
    return cache.view(torch.uint8) if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else cache


def check_kv_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """Raises ValueError naming ``kv_scales`` unless an int8 cache has its (2, num_blocks, block_size,
    num_kv_heads) float32 contiguous scales and no other cache has any."""
    if (kv_cache.dtype == torch.int8) != (kv_scales is not None):
        raise ValueError("an int8 KV cache needs kv_scales (and only an int8 one has them)")
    if kv_scales is not None and (kv_scales.dtype != torch.float32 or not kv_scales.is_contiguous()
                                  or tuple(kv_scales.shape) != tuple(kv_cache.shape[:4])):
        raise ValueError(f"kv_scales must be contiguous float32 of shape {tuple(kv_cache.shape[:4])}, got "
                         f"{kv_scales.dtype} {tuple(kv_scales.shape)}")


@triton.jit
def encode_fp8(x, KV_FORMAT: tl.constexpr):
    """float32 values -> uint8 float8 codes (e4m3fn for KV_FORMAT 1, e5m2 for 2), nearest even, saturating."""
    # per format: mantissa shift 23 - M, exponent rebias (127 - B) << M, the largest finite value,
    # the smallest normal 2^(1 - B), and the subnormal magic 2^(24 - B - M) (float32 bits too)
    if KV_FORMAT == 1:  # e4m3fn: M = 3, B = 7
        shift, rebias, max_value, min_normal, magic, magic_bits = 20, 120 << 3, 448.0, 0.015625, 16384.0, 141 << 23
    else:  # e5m2: M = 2, B = 15
        shift, rebias, max_value, min_normal, magic, magic_bits = 21, 112 << 2, 57344.0, 6.103515625e-05, 128.0, 134 << 23
    a = tl.minimum(tl.abs(x), max_value)
    bits = a.to(tl.int32, bitcast=True)
    # normal: round the float32 mantissa at bit `shift` to nearest even, then rebias the exponent
    normal = ((bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift) - rebias
    # subnormal: a + magic has float32 spacing equal to the target's subnormal step, so the rounded
    # sum's low bits are the code (2^M when it rounds up to the smallest normal, whose code that is)
    sub = (a + magic).to(tl.int32, bitcast=True) - magic_bits
    code = tl.where(a < min_normal, sub, normal)
    code = tl.where(x.to(tl.int32, bitcast=True) < 0, code | 0x80, code)  # the sign bit (-0.0 too)
    return code.to(tl.uint8)


@triton.jit
def decode_fp8(code, KV_FORMAT: tl.constexpr):
    """uint8 float8 codes -> float32 values (exact for every finite code)."""
    if KV_FORMAT == 1:  # e4m3fn: 7 magnitude bits eeeemmm, subnormal step 2^-9
        shift, rebias, sub_limit, sub_step = 20, 120 << 23, 8, 0.001953125
    else:  # e5m2: eeeeemm, subnormal step 2^-16
        shift, rebias, sub_limit, sub_step = 21, 112 << 23, 4, 1.52587890625e-05
    c = code.to(tl.int32)
    mag = c & 0x7F
    normal = ((mag << shift) + rebias).to(tl.float32, bitcast=True)
    value = tl.where(mag < sub_limit, mag.to(tl.float32) * sub_step, normal)
    return tl.where((c & 0x80) != 0, -value, value)


@triton.jit
def quantize_int8_rows(x):
    """x (H, D) float32 -> (int8 codes (H, D), scales (H,) float32): ``scale = max|x| / 127`` per row (1 for
    an all-zero row), codes ``round(x / scale)`` to nearest even."""
    scales = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)
    scales = tl.where(scales > 0, scales, 1.0)
    y = tl.math.div_rn(x, scales[:, None])
    # 1.5 * 2^23 + y (|y| <= 127) has float32 spacing 1: the hardware rounds y to nearest even
    q = (y + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
    q = tl.minimum(tl.maximum(q, -127), 127)
    return q.to(tl.int8), scales


@triton.jit
def kv_codes(raw, dtype, KV_FORMAT: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """Cached K or V codes as ``dtype`` values, still to be multiplied by their scales."""
    if KV_FORMAT == 0 or KV_FORMAT == 3:
        return raw.to(dtype)
    elif NATIVE_FP8:
        if KV_FORMAT == 1:
            return raw.to(tl.float8e4nv, bitcast=True).to(dtype)
        else:
            return raw.to(tl.float8e5, bitcast=True).to(dtype)
    else:
        return decode_fp8(raw, KV_FORMAT).to(dtype)
