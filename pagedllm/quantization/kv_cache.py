"""KV-cache dtypes (vLLM's names): the cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.

fp8: one scale for K and one for V per layer (1.0 without checkpoint scales), saturating. int8:
``scale = max|x| / 127`` over head_dim, in ``kv_scales[2, num_blocks, block_size, num_kv_heads]`` float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import KV_CACHE_DTYPES
_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class KVCacheDtype:
    """The resolved KV-cache storage; fp8 stores value / ``tensor_scale``."""

    name: str
    storage: torch.dtype
    has_token_scales: bool = False
    tensor_scale: float = 1.0

    @property
    def is_quantized(self) -> bool:
        return self.storage in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes one token's K (or V) takes for one KV head, scales included."""
        return head_dim * torch.tensor([], dtype=self.storage).element_size() + (4 if self.has_token_scales else 0)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> KVCacheDtype:
    """The storage for ``kv_cache_dtype=name``. Raises ValueError (unknown name, fp8 without float8 torch)."""
    if name == "auto":
        return KVCacheDtype("auto", model_dtype)
    if name == "bfloat16":
        return KVCacheDtype("bfloat16", torch.bfloat16)
    if name == "int8":
        return KVCacheDtype("int8", torch.int8, has_token_scales=True)
    if name in _FP8:
        storage = getattr(torch, _FP8[name], None)
        if storage is None:
            raise ValueError(f"kv_cache_dtype={name!r} needs a torch build with {_FP8[name]} (torch {torch.__version__} "
                             f"has none)")
        return KVCacheDtype("fp8_e5m2" if name == "fp8_e5m2" else "fp8_e4m3", storage)
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


def quantize_kv(x: torch.Tensor, storage: torch.dtype, tensor_scale: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (T, num_kv_heads, head_dim) → (values in ``storage``, int8's (T, num_kv_heads) float32 scales or None)."""
    if storage == torch.int8:
        xf = x.float()
        scales = xf.abs().amax(dim=-1) / 127.0  # (T, num_kv_heads)
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(xf / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        return q, scales
    if tensor_scale != 1.0:
        x = x / tensor_scale
    if storage in (torch.float8_e4m3fn, torch.float8_e5m2):
        # torch's e5m2 conversion overflows to inf; every backend's writer clamps alike
        limit = torch.finfo(storage).max
        x = x.clamp(-limit, limit)
    return x.to(storage), None


def dequantize_kv(values: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype,
                  tensor_scale: float = 1.0) -> torch.Tensor:
    """Cached K or V back in ``dtype``: values (..., head_dim), scales (...) float32 for int8."""
    out = values.to(dtype)
    if scales is not None:
        out = out.mul_(scales.to(dtype).unsqueeze(-1))
    elif tensor_scale != 1.0:
        out = out.mul_(tensor_scale)
    return out


def round_trip_kv(x: torch.Tensor, storage: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    stored, scales = quantize_kv(x, storage)
    return dequantize_kv(stored, scales, dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 viewed as uint8 (no ``index_copy_``/``index_select`` on CPU); other tensors unchanged."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
