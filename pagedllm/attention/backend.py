"""Attention backend interface, per-step metadata, and the forward context.

KV-cache layout, per layer: ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = keys, 1 = values). A token at position p of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size`` — that slot number is the
one definition of "slot" in this project (``slot_mapping`` carries it per new token).

The metadata for a step travels in a context object set by :func:`set_forward_context`
for the duration of one forward pass, not in module globals.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import torch
import torch.nn.functional as F

from pagedllm.quantization.kv_cache import as_bytes, dequantize_kv, quantize_kv


@dataclass
class AttentionMetadata:
    """The flat ragged batch of one step, as the attention layers see it.

    Requests are ordered decodes first (query length 1), then prefills (query length
    > 1, including chunks), so backends can treat the two groups separately.

    Shapes and dtypes (T = tokens this step, B = requests this step):
        slot_mapping:    [T] int64  — cache slot each new token's K/V is written to
        query_start_loc: [B+1] int32 — request b's tokens are rows qsl[b]:qsl[b+1]
        seq_lens:        [B] int32  — context length after this step (cached + new)
        block_tables:    [B, max_num_blocks] int32 — physical block ids, padded with 0
        num_decodes:     requests (the first ones) with exactly one query token
        num_decode_tokens: == num_decodes
        max_query_len, max_seq_len: maxima over the batch (tokens)
        query_start_loc_cpu, seq_lens_cpu: host copies (lists) for backends that
            need Python ints without a device sync
    """

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


class AttentionBackend(Protocol):
    """Writes new K/V into the paged cache and computes causal attention.

    ``forward(query, key, value, kv_cache, metadata, scale, sliding_window=None, logit_soft_cap=None)``:
        query: [T, num_heads, head_dim]; key/value: [T, num_kv_heads, head_dim]
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (written in place)
        scale: the softmax scale (``head_dim ** -0.5`` unless the model says otherwise)
        sliding_window: W, or None for full attention: the token at position p attends to
            keys at positions p - W < k <= p (transformers' sliding-window mask); blocks
            wholly before p - W + 1 are never read, so their table entries may be stale
        logit_soft_cap: c, or None: scores become ``c * tanh(scores / c)`` before the mask
            and softmax (Gemma 2's attention-logit soft-capping)
        returns: [T, num_heads, head_dim], dtype of ``query``.
    Grouped-query attention: query head h reads KV head h // (num_heads // num_kv_heads).

    A backend with ``supports_quantized_kv = True`` also takes fp8/int8 caches, an int8 one
    with ``kv_scales=`` (2, num_blocks, block_size, num_kv_heads) float32
    (:mod:`pagedllm.quantization.kv_cache`); without the attribute, only float caches.
    """

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None, logit_soft_cap: float | None = None) -> torch.Tensor: ...


@dataclass
class ForwardContext:
    """What every attention layer needs during one forward pass.

    ``group_metadata[g]`` is the metadata of KV-cache group ``g`` (its own block tables
    and slot mapping; see :mod:`pagedllm.core.kv_cache_groups`); ``attn_metadata`` is
    group 0's (the only one for a model without sliding-window layers), or None.
    """

    attn_metadata: AttentionMetadata | None
    group_metadata: tuple[AttentionMetadata, ...] = ()

    def metadata_for(self, group: int) -> AttentionMetadata | None:
        """The metadata of KV-cache group ``group`` (None in a pass without metadata).
        Raises IndexError for a group the pass has no metadata for."""
        if self.attn_metadata is None:
            return None
        if group == 0:
            return self.attn_metadata
        return self.group_metadata[group]


_local = threading.local()


@contextlib.contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | Sequence[AttentionMetadata] | None
                        ) -> Iterator[ForwardContext]:
    """Make the step's metadata visible to the attention layers for one forward pass:
    one :class:`AttentionMetadata`, or one per KV-cache group (a list or tuple), or None."""
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


# -- helpers shared by the backends ------------------------------------------------------

def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """Write new keys/values into the paged cache, in place, in the cache's storage dtype.

    Args:
        key, value: (T, num_kv_heads, head_dim), any float dtype; rounded to the cache's
            dtype (float8 saturates; int8 is quantized per token and head,
            :func:`pagedllm.quantization.kv_cache.quantize_kv`).
        kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim), contiguous.
        slot_mapping: (T,) int64, each in [0, num_blocks * block_size). Negative slots are
            not supported (the runner never pads).
        kv_scales: (2, num_blocks, block_size, num_kv_heads) float32 for an int8 cache (the
            per token-and-head scales, written at the same slots); None otherwise.
    Raises ValueError for an int8 cache without ``kv_scales``.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    if (kv_cache.dtype == torch.int8) != (kv_scales is not None):
        raise ValueError("an int8 KV cache needs kv_scales (and only an int8 one has them)")
    for i, new in enumerate((key, value)):
        stored, scales = quantize_kv(new, kv_cache.dtype)
        cache = as_bytes(kv_cache[i]).view(-1, num_kv_heads, head_dim)  # (num_slots, num_kv_heads, head_dim)
        cache.index_copy_(0, slot_mapping, as_bytes(stored))
        if scales is not None:
            kv_scales[i].view(-1, num_kv_heads).index_copy_(0, slot_mapping, scales)


def read_kv_blocks(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, block_ids: torch.Tensor,
                   dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """K and V of the blocks ``block_ids`` (n,), dequantized to ``dtype``.

    Returns (2, n, block_size, num_kv_heads, head_dim). ``out``, if given, is a buffer of the
    cache's dtype and that shape the raw blocks are gathered into (no allocation when the
    cache is already in ``dtype``: the result is then ``out`` itself).
    """
    raw = torch.index_select(as_bytes(kv_cache), 1, block_ids, out=None if out is None else as_bytes(out))
    raw = raw.view(kv_cache.dtype)
    scales = None if kv_scales is None else kv_scales.index_select(1, block_ids)
    if raw.dtype == dtype:
        return raw
    return dequantize_kv(raw, scales, dtype)


def check_shapes(query: torch.Tensor, key: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Cheap host-side layout checks (no device sync). Raises ValueError naming the mismatch."""
    cache_shape, key_shape, query_shape = kv_cache.shape, key.shape, query.shape  # each read once: called per layer
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
    """The active forward context if ``metadata`` is its group-0 metadata, else None.

    Backends key per-pass caches (decode plans) by this context; the other KV-cache groups'
    metadata have other block tables, so they get None (no caching) and never a plan of
    another group's tables.
    """
    try:
        ctx = get_forward_context()
    except RuntimeError:
        return None
    return ctx if ctx.attn_metadata is metadata else None


def attention_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) mask, True = attend: (Q,) and (S,) positions -> (Q, S) bool.

    Key k is visible to query q when ``k <= q`` and, with a window W, ``k > q - W``.
    """
    q, k = query_pos.unsqueeze(1), key_pos.unsqueeze(0)
    mask = k <= q
    if sliding_window is not None:
        mask &= k > q - sliding_window
    return mask


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, logit_soft_cap: float | None = None) -> torch.Tensor:
    """softmax(cap(scale * q k^T) masked) v, the reference every backend must equal.

    Args:
        query: (..., Hq, Q, D); key, value: (..., Hk, S, D) with Hq a multiple of Hk (query
            head h reads key head h // (Hq // Hk)).
        mask: bool broadcastable to (..., Hq, Q, S), True = attend; None = causal, top-left
            aligned (Q == S). Every query row must see at least one key.
        logit_soft_cap: c or None: scores become ``c * tanh(scores / c)`` before masking.
    Returns:
        (..., Hq, Q, D) in query's dtype.
    """
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
