"""A decode-only step's call of the C decode kernel (``cpu_paged.c``), prepared once for all layers: the
plan fills ``struct paged_decode_call`` once, and each later matching layer writes five pointers."""

from __future__ import annotations

import ctypes

import torch

from pagedllm.attention.backend import AttentionImpl, ForwardContext

__all__ = ["DecodeCall", "DecodePlan"]

_p, _i, _ll, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float


class DecodeCall(ctypes.Structure):
    """``struct paged_decode_call`` of ``cpu_paged.c``: the arguments of ``paged_decode_<format>`` in order."""

    _fields_ = [("q", _p), ("k_cache", _p), ("v_cache", _p), ("k_scales", _p), ("v_scales", _p),
                ("block_tables", _p), ("seq_lens", _p), ("out", _p),
                ("req_begin", _i), ("req_end", _i), ("num_heads", _i), ("num_kv_heads", _i), ("head_dim", _i),
                ("block_size", _i), ("block_table_stride", _ll), ("kv_block_stride", _ll), ("kv_token_stride", _ll),
                ("scale", _f), ("k_scale", _f), ("v_scale", _f), ("window", _i), ("soft_cap", _f),
                ("io_bf16", _i), ("num_threads", _i), ("key", _p), ("value", _p), ("key_stride", _ll),
                ("value_stride", _ll), ("slots", _p), ("num_tokens", _i)]


class DecodePlan:
    """The K/V write and decode of a decode-only step, planned from the first layer's ``impl`` and tensors
    (whose shapes, dtypes and strides later layers must match) and the validated ``block_tables`` (D,
    max_blocks) int32, ``seq_lens`` (D,) int32 and ``slots`` (D,) int64; valid while ``owner`` is current."""

    def __init__(self, owner: ForwardContext, fn, impl: AttentionImpl, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 slots: torch.Tensor, num_threads: int) -> None:
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        kv_block_stride = block_size * num_kv_heads * head_dim
        self.owner = owner
        self._fn = fn
        self._tensors = (block_tables, seq_lens, slots)  # the struct holds their pointers
        self._cache_shape, self._cache_dtype = kv_cache.shape, kv_cache.dtype
        self._query_shape, self._kv_shape, self._dtype = query.shape, key.shape, query.dtype
        self._key_stride, self._value_stride = key.stride(), value.stride()
        self._options = impl.options
        scale, sliding_window, logit_soft_cap = impl.options
        self._v_offset = num_blocks * kv_block_stride * kv_cache.element_size()  # bytes from K to V
        self._call = DecodeCall(
            block_tables=block_tables.data_ptr(), seq_lens=seq_lens.data_ptr(), req_begin=0, req_end=query.shape[0],
            num_heads=query.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
            block_table_stride=block_tables.stride(0), kv_block_stride=kv_block_stride,
            kv_token_stride=num_kv_heads * head_dim, scale=scale, k_scale=1.0, v_scale=1.0,
            window=sliding_window or 0, soft_cap=logit_soft_cap or 0.0, io_bf16=query.dtype == torch.bfloat16,
            num_threads=num_threads, key_stride=key.stride(0), value_stride=value.stride(0),
            slots=slots.data_ptr(), num_tokens=key.shape[0])
        self._call_ref = ctypes.byref(self._call)

    def matches(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                options: tuple) -> bool:
        """Whether a layer's call is this plan's with other tensors of the same shapes, dtypes and strides."""
        dtype = self._dtype
        return (kv_cache.shape == self._cache_shape and kv_cache.dtype is self._cache_dtype and kv_cache.is_cpu
                and kv_cache.is_contiguous() and query.shape == self._query_shape and query.dtype is dtype
                and query.is_cpu and query.is_contiguous() and key.dtype is dtype and value.dtype is dtype
                and key.shape == self._kv_shape and value.shape == self._kv_shape and key.is_cpu and value.is_cpu
                and key.stride() == self._key_stride and value.stride() == self._value_stride
                and options == self._options)

    def call_for(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 out: torch.Tensor) -> DecodeCall:
        """A new struct of this plan's call for a layer's tensors (they :meth:`match`), writing into ``out``."""
        call = DecodeCall.from_buffer_copy(self._call)
        cache = kv_cache.data_ptr()
        call.q, call.k_cache, call.v_cache, call.out = query.data_ptr(), cache, cache + self._v_offset, out.data_ptr()
        call.key, call.value = key.data_ptr(), value.data_ptr()
        return call

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Write the layer's K/V rows and return its decode attention, (D, num_heads, head_dim) in query's
        dtype. Raises MemoryError when the kernel's scratch fails."""
        out = torch.empty(self._query_shape, dtype=self._dtype)
        call, cache = self._call, kv_cache.data_ptr()
        call.q, call.k_cache, call.v_cache, call.out = query.data_ptr(), cache, cache + self._v_offset, out.data_ptr()
        call.key, call.value = key.data_ptr(), value.data_ptr()
        if self._fn(self._call_ref) != 0:
            raise MemoryError("CPU paged-attention decode kernel: scratch allocation failed")
        return out
