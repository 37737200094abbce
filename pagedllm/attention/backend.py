"""The attention backend interface, the per-step metadata and the forward context. KV-cache layout per layer:
``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V); position p of a request is
slot ``block_table[p // block_size] * block_size + p % block_size``."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from pagedllm.quantization.kv_cache import as_bytes, dequantize_kv, quantize_kv


@dataclass
class AttentionMetadata:
    """The flat ragged batch of one step, decodes (query length 1) first. slot_mapping [T] int64;
    query_start_loc [B+1] int32; seq_lens [B] int32 (cached + new); block_tables [B, max_num_blocks]
    int32, padded with 0; query_start_loc_cpu, seq_lens_cpu: host lists (no device sync)."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionImpl:
    """One layer's attention on a backend, its constants bound once (vLLM's ``AttentionImpl``).
    ``sliding_window`` W: position p attends to keys p - W < k <= p; ``logit_soft_cap`` c: scores
    ``c * tanh(s / c)`` (Gemma 2). ``forward`` writes the step's K/V at ``metadata.slot_mapping`` and returns
    causal attention: query (T, num_heads, head_dim), key/value (T, num_kv_heads, head_dim) -> (T, num_heads,
    head_dim) in query's dtype. Raises ValueError for a window < 1 or a layout that does not match."""

    def __init__(self, backend: AttentionBackend, scale: float, sliding_window: int | None = None,
                 logit_soft_cap: float | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.backend = backend
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_soft_cap = logit_soft_cap or None
        self.options = (scale, sliding_window, self.logit_soft_cap)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        check_shapes(query, key, kv_cache)
        self.write_kv(key, value, kv_cache, metadata.slot_mapping, kv_scales)
        return self._attend(query, key, value, kv_cache, metadata, kv_scales)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None) -> None:
        write_kv_cache(key, value, kv_cache, slot_mapping, kv_scales)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, kv_scales: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def decode_tasks(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     kv_scales: torch.Tensor | None, out: torch.Tensor, metadata: AttentionMetadata):
        """Right after :meth:`forward` ran a decode-only step, that call's task forms for a CPU decode graph's
        native replay writing into ``out`` (:mod:`pagedllm.ops.graph_replay`): ``(tasks, refresh hook)``, the hook
        giving a later step's values of their per-step fields or None; None when this backend has none."""
        return None


class AttentionBackend:
    """What a model's layers share: buffers and the current pass's plans (not thread-safe)."""

    impl_cls: type[AttentionImpl] = AttentionImpl
    supports_quantized_kv = False
    supports_cuda_graphs = False

    def make_impl(self, scale: float, sliding_window: int | None = None,
                  logit_soft_cap: float | None = None) -> AttentionImpl:
        return self.impl_cls(self, scale, sliding_window, logit_soft_cap)


@dataclass
class ForwardContext:
    """What every attention layer needs during one forward pass: ``group_metadata[g]`` is KV-cache group g's."""

    attn_metadata: AttentionMetadata | None
    group_metadata: tuple[AttentionMetadata, ...] = ()

    def metadata_for(self, group: int) -> AttentionMetadata | None:
        """Group ``group``'s metadata (None in a pass without). Raises IndexError for an unknown group."""
        if self.attn_metadata is None:
            return None
        if group == 0:
            return self.attn_metadata
        return self.group_metadata[group]


_local = threading.local()


@contextlib.contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | Sequence[AttentionMetadata] | None
                        ) -> Iterator[ForwardContext]:
    prev = getattr(_local, "ctx", None)
    if isinstance(attn_metadata, (list, tuple)):
        ctx = ForwardContext(attn_metadata[0], tuple(attn_metadata))
    else:
        ctx = ForwardContext(attn_metadata, (attn_metadata,) if attn_metadata is not None else ())
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = prev


def get_forward_context() -> ForwardContext:
    """The context set by :func:`set_forward_context`. Raises RuntimeError outside one."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("attention called outside set_forward_context()")
    return ctx


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """key, value (T, num_kv_heads, head_dim) into ``kv_cache`` at ``slot_mapping`` (T,) int64, in the cache's
    storage dtype (int8: scales into ``kv_scales``). Raises ValueError for an int8 cache without ``kv_scales``
    or another with them."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    if (kv_cache.dtype == torch.int8) != (kv_scales is not None):
        raise ValueError("an int8 KV cache needs kv_scales (and only an int8 one has them)")
    for i, new in enumerate((key, value)):
        stored, scales = quantize_kv(new, kv_cache.dtype)
        cache = as_bytes(kv_cache[i]).view(-1, num_kv_heads, head_dim)
        cache.index_copy_(0, slot_mapping, as_bytes(stored))
        if scales is not None:
            kv_scales[i].view(-1, num_kv_heads).index_copy_(0, slot_mapping, scales)


def read_kv_blocks(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, block_ids: torch.Tensor,
                   dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """K and V of blocks ``block_ids`` (n,) in ``dtype``: (2, n, block_size, num_kv_heads, head_dim)."""
    raw = torch.index_select(as_bytes(kv_cache), 1, block_ids, out=None if out is None else as_bytes(out))
    raw = raw.view(kv_cache.dtype)
    scales = None if kv_scales is None else kv_scales.index_select(1, block_ids)
    if raw.dtype == dtype:
        return raw
    return dequantize_kv(raw, scales, dtype)


def check_shapes(query: torch.Tensor, key: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Cheap host-side layout checks (no device sync). Raises ValueError naming the mismatch."""
    cache_shape, key_shape, query_shape = kv_cache.shape, key.shape, query.shape
    if len(cache_shape) != 5 or cache_shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(cache_shape)}")
    if cache_shape[3:] != key_shape[1:]:
        raise ValueError(f"kv_cache (num_kv_heads, head_dim)={tuple(cache_shape[3:])} does not match "
                         f"key {tuple(key_shape[1:])}")
    if query_shape[2] != key_shape[2] or query_shape[1] % key_shape[1]:
        raise ValueError(f"query heads/head_dim {tuple(query_shape[1:])} incompatible with key "
                         f"{tuple(key_shape[1:])}: num_heads must be a multiple of num_kv_heads")


def current_context(metadata: AttentionMetadata) -> ForwardContext | None:
    """The active forward context if ``metadata`` is its group-0 metadata, else None (keys per-pass plans)."""
    try:
        ctx = get_forward_context()
    except RuntimeError:
        return None
    return ctx if ctx.attn_metadata is metadata else None


def step_context(metadata: AttentionMetadata) -> ForwardContext | None:
    """The active forward context if ``metadata`` is the metadata of one of its KV-cache groups, else None."""
    try:
        ctx = get_forward_context()
    except RuntimeError:
        return None
    if ctx.attn_metadata is metadata or any(m is metadata for m in ctx.group_metadata):
        return ctx
    return None


def attention_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """(Q,) and (S,) positions -> (Q, S) bool, True = attend: ``k <= q`` and, with a window W, ``k > q - W``."""
    q, k = query_pos.unsqueeze(1), key_pos.unsqueeze(0)
    mask = k <= q
    if sliding_window is not None:
        mask &= k > q - sliding_window
    return mask


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, logit_soft_cap: float | None = None) -> torch.Tensor:
    """softmax(cap(scale * q k^T) masked) v, the reference every backend must equal. query (..., Hq, Q, D);
    key, value (..., Hk, S, D); mask bool, True = attend (None: causal) -> (..., Hq, Q, D) in query's dtype."""
    key, value = key.to(query.dtype), value.to(query.dtype)
    if logit_soft_cap is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=True)
    group = query.shape[-3] // key.shape[-3]
    if group > 1:
        key, value = key.repeat_interleave(group, dim=-3), value.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale  # (..., Hq, Q, S)
    scores = torch.tanh(scores / logit_soft_cap) * logit_soft_cap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(value.dtype), value)
