"""The reference paged-attention backend in plain PyTorch (PagedAttention, Kwon et al., SOSP 2023, as
gathers + SDPA): decodes batched into a reusable workspace, prefills one request at a time."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadata, ForwardContext,
                                        attention_mask, current_context, masked_attention, read_kv_blocks)
from pagedllm.quantization.kv_cache import round_trip_kv
from pagedllm.utils import cdiv

# Decode groups gather at most this much K/V: on CPU a group's copy is still in cache when SDPA reads it.
_CPU_WORKSPACE_BYTES = 8 * 1024**2
_CUDA_WORKSPACE_BYTES = 1024**3


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, kv_scales: torch.Tensor | None = None,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` tokens' K and V of one request through its block table, in ``dtype``
    (default the cache's): each (seq_len, num_kv_heads, head_dim), new tensors."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_blocks = cdiv(seq_len, block_size)
    kv = read_kv_blocks(kv_cache, kv_scales, block_table[:num_blocks], dtype or kv_cache.dtype)
    kv = kv.view(2, num_blocks * block_size, num_kv_heads, head_dim)[:, :seq_len]
    return kv[0], kv[1]


class TorchPagedAttentionImpl(AttentionImpl):
    """One layer on :class:`TorchPagedAttention`."""

    backend: TorchPagedAttention

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, kv_scales: torch.Tensor | None, **decode_options) -> torch.Tensor:
        output = torch.empty_like(query)
        num_decodes = metadata.num_decodes
        if 0 < num_decodes == query.shape[0]:
            self._decode(query, kv_cache, metadata, output, kv_scales, **decode_options)
        elif num_decodes > 0:
            self._decode(query[:num_decodes], kv_cache, metadata, output[:num_decodes], kv_scales, **decode_options)
        if num_decodes < metadata.num_reqs:
            self._prefill(query, key, value, kv_cache, metadata, output, kv_scales)
        return output

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata, output: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for b in range(metadata.num_decodes, metadata.num_reqs):
            start, end = qsl[b], qsl[b + 1]
            output[start:end] = _prefill_one(query[start:end], key[start:end], value[start:end], kv_cache,
                                             metadata.block_tables[b], seq_lens[b], self.scale, self.sliding_window,
                                             self.logit_soft_cap, kv_scales)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                out: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
        num_decodes = query.shape[0]
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        backend = self.backend
        plan = backend.decode_plan(metadata, block_size, self.sliding_window)
        bytes_per_req = 2 * plan.max_len * num_kv_heads * head_dim * kv_cache.element_size()
        cap = backend.max_workspace_bytes or _default_workspace_bytes(kv_cache.device)
        group = max(1, min(num_decodes, cap // bytes_per_req))
        workspace = backend.workspace(group * bytes_per_req // kv_cache.element_size(), kv_cache)
        for i in range(0, num_decodes, group):
            j = min(i + group, num_decodes)
            out[i:j] = _decode_group(query[i:j], kv_cache, plan.block_tables[i:j], plan.mask[i:j], self.scale,
                                     workspace, self.logit_soft_cap, kv_scales)


class TorchPagedAttention(AttentionBackend):
    """Paged attention in PyTorch ops, shared by a model's layers. ``max_workspace_bytes`` caps the decode
    gather buffer (default 8 MiB on CPU, 1 GiB on CUDA); raises ValueError when not positive."""

    impl_cls = TorchPagedAttentionImpl
    supports_quantized_kv = True

    def __init__(self, max_workspace_bytes: int | None = None) -> None:
        if max_workspace_bytes is not None and max_workspace_bytes <= 0:
            raise ValueError(f"max_workspace_bytes must be positive, got {max_workspace_bytes}")
        self.max_workspace_bytes = max_workspace_bytes
        self._workspace: torch.Tensor | None = None
        self._plans: dict[int | None, _DecodePlan] = {}  # by sliding window

    def decode_plan(self, metadata: AttentionMetadata, block_size: int, sliding_window: int | None = None
                    ) -> _DecodePlan:
        """The decodes' block tables and key mask, once per forward pass and window (keyed by the pass's
        ForwardContext, so metadata refilled in place never meets a stale plan)."""
        owner = current_context(metadata)
        plan = self._plans.get(sliding_window)
        if owner is not None and plan is not None and plan.owner is owner and plan.block_size == block_size:
            return plan
        if owner is None or any(p.owner is not owner for p in self._plans.values()):
            self._plans = {}
        if sliding_window is None:
            plan = _full_decode_plan(owner, metadata, block_size)
        else:
            plan = _window_decode_plan(owner, metadata, block_size, sliding_window)
        if owner is not None:
            self._plans[sliding_window] = plan
        return plan

    def workspace(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        ws = self._workspace
        if ws is None or ws.numel() < numel or ws.dtype != like.dtype or ws.device != like.device:
            ws = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._workspace = ws
        return ws[:numel]


@dataclass
class _DecodePlan:

    owner: ForwardContext | None
    block_size: int
    max_len: int  # the longest decode context rounded up to blocks
    block_tables: torch.Tensor  # (D, max_len // block_size) int32
    mask: torch.Tensor  # (D, 1, 1, max_len) bool, True = attend


def _full_decode_plan(owner: ForwardContext | None, metadata: AttentionMetadata, block_size: int) -> _DecodePlan:
    num_decodes = metadata.num_decodes
    num_blocks = cdiv(max(metadata.seq_lens_cpu[:num_decodes]), block_size)
    max_len = num_blocks * block_size
    positions = torch.arange(max_len, device=metadata.seq_lens.device)
    mask = positions < metadata.seq_lens[:num_decodes].unsqueeze(1)  # (D, max_len)
    return _DecodePlan(owner, block_size, max_len, metadata.block_tables[:num_decodes, :num_blocks],
                       mask.view(num_decodes, 1, 1, max_len))


def _window_decode_plan(owner: ForwardContext | None, metadata: AttentionMetadata, block_size: int,
                        window: int) -> _DecodePlan:
    """Each decode reads only the blocks of its last ``window`` tokens."""
    num_decodes = metadata.num_decodes
    device = metadata.seq_lens.device
    seq_lens = metadata.seq_lens[:num_decodes].long()
    num_blocks = cdiv(max(metadata.seq_lens_cpu[:num_decodes]), block_size)
    width = min(num_blocks, (window - 1) // block_size + 2)
    first = (seq_lens - window).clamp(min=0) // block_size
    logical = first.unsqueeze(1) + torch.arange(width, device=device)  # (D, width)
    tables = metadata.block_tables[:num_decodes].gather(1, logical.clamp(max=num_blocks - 1))
    positions = (logical.unsqueeze(2) * block_size + torch.arange(block_size, device=device)).view(num_decodes, -1)
    mask = (positions < seq_lens.unsqueeze(1)) & (positions >= (seq_lens - window).unsqueeze(1))
    max_len = width * block_size
    return _DecodePlan(owner, block_size, max_len, tables, mask.view(num_decodes, 1, 1, max_len))


def _default_workspace_bytes(device: torch.device) -> int:
    return _CPU_WORKSPACE_BYTES if device.type == "cpu" else _CUDA_WORKSPACE_BYTES


def _decode_group(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  mask: torch.Tensor, scale: float, workspace: torch.Tensor,
                  logit_soft_cap: float | None = None, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """query (D, num_heads, head_dim), block_tables (D, nb) int32, mask (D, 1, 1, nb * block_size) bool."""
    num_reqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    nb = block_tables.shape[1]
    max_len = nb * block_size
    group_size = num_heads // num_kv_heads
    kv = workspace[:2 * num_reqs * max_len * num_kv_heads * head_dim].view(
        2, num_reqs * nb, block_size, num_kv_heads, head_dim)
    kv = read_kv_blocks(kv_cache, kv_scales, block_tables.reshape(-1), query.dtype, out=kv)
    kv = kv.view(2, num_reqs, max_len, num_kv_heads, head_dim)
    keys = kv[0].transpose(1, 2).to(query.dtype)  # (D, num_kv_heads, max_len, head_dim), a view
    values = kv[1].transpose(1, 2).to(query.dtype)
    q = query.view(num_reqs, num_kv_heads, group_size, head_dim)  # (D, num_kv_heads, group, head_dim)
    out = masked_attention(q, keys, values, mask, scale, logit_soft_cap)
    return out.reshape(num_reqs, num_heads, head_dim)


def _prefill_one(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_len: int, scale: float, sliding_window: int | None = None,
                 logit_soft_cap: float | None = None, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one request's Q new tokens, the last Q of ``seq_len`` (K/V already cached):
    query (Q, num_heads, head_dim), key/value (Q, num_kv_heads, head_dim) -> (Q, num_heads, head_dim).
    Fresh K/V are rounded as a lower-precision cache stores them first."""
    if kv_cache.dtype != query.dtype:  # attend over the K/V as stored, as every later read will
        key, value = round_trip_kv(key, kv_cache.dtype, query.dtype), round_trip_kv(value, kv_cache.dtype, query.dtype)
    if sliding_window is not None or logit_soft_cap is not None:
        return _prefill_one_masked(query, key, value, kv_cache, block_table, seq_len, scale, sliding_window,
                                   logit_soft_cap, kv_scales)
    query_len = query.shape[0]
    num_context = seq_len - query_len
    q = query.transpose(0, 1).unsqueeze(0)  # (1, num_heads, Q, head_dim)
    if num_context == 0:
        k, v = key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)
    if query.device.type == "cpu" and _cpu_flash_attention is not None:
        prefix_keys, prefix_values = gather_kv(kv_cache, block_table, num_context, kv_scales, query.dtype)
        return _prefix_chunk_attention(q, prefix_keys, prefix_values, key, value, scale)
    keys, values = gather_kv(kv_cache, block_table, seq_len, kv_scales, query.dtype)
    # bottom-right causal: query i (position num_context + i) sees keys up to num_context + i
    key_pos = torch.arange(seq_len, device=query.device)
    query_pos = torch.arange(num_context, seq_len, device=query.device)
    mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # (Q, seq_len)
    out = F.scaled_dot_product_attention(q, keys.transpose(0, 1).unsqueeze(0).to(q.dtype),
                                         values.transpose(0, 1).unsqueeze(0).to(q.dtype),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


# SDPA's CPU flash kernel, called directly for the per-row log-sum-exp the merge needs
_cpu_flash_attention = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _prefix_chunk_attention(q: torch.Tensor, prefix_keys: torch.Tensor, prefix_values: torch.Tensor,
                            chunk_keys: torch.Tensor, chunk_values: torch.Tensor, scale: float) -> torch.Tensor:
    """Q chunk queries over C cached keys and, causally, the chunk's own: two flash calls merged as
    ``o1 + (o2 - o1) * sigmoid(lse2 - lse1)`` (FlashDecoding, Dao et al. 2023). q (1, num_heads, Q,
    head_dim); prefix (C, num_kv_heads, head_dim); chunk (Q, ...) -> (Q, num_heads, head_dim)."""
    dtype = q.dtype
    pk, pv = prefix_keys.transpose(0, 1).unsqueeze(0), prefix_values.transpose(0, 1).unsqueeze(0)
    ck, cv = chunk_keys.transpose(0, 1).unsqueeze(0), chunk_values.transpose(0, 1).unsqueeze(0)
    o1, lse1 = _cpu_flash_attention(q, pk.to(dtype), pv.to(dtype), scale=scale)  # (1, H, Q, D), (1, H, Q)
    o2, lse2 = _cpu_flash_attention(q, ck.to(dtype), cv.to(dtype), is_causal=True, scale=scale)
    weight = torch.sigmoid(lse2 - lse1).unsqueeze(-1)  # (1, H, Q, 1) float32
    out = torch.empty(q.shape[2], q.shape[1], q.shape[3], dtype=torch.float32, device=q.device)
    torch.lerp(o1.float(), o2.float(), weight, out=out.transpose(0, 1).unsqueeze(0))
    return out.to(dtype)

def _prefill_one_masked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                        block_table: torch.Tensor, seq_len: int, scale: float, sliding_window: int | None,
                        logit_soft_cap: float | None, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`_prefill_one` with a sliding window and/or soft cap -> (Q, num_heads, head_dim)."""
    query_len = query.shape[0]
    num_context = seq_len - query_len
    q = query.transpose(0, 1).unsqueeze(0)  # (1, num_heads, Q, head_dim)
    block_size = kv_cache.shape[2]
    first_block = 0 if sliding_window is None else max(0, num_context - sliding_window + 1) // block_size
    first_key = first_block * block_size
    if num_context == 0:
        keys, values = key, value
    else:
        keys, values = gather_kv(kv_cache, block_table[first_block:], seq_len - first_key, kv_scales, query.dtype)
    mask = attention_mask(torch.arange(num_context, seq_len, device=query.device),
                          torch.arange(first_key, seq_len, device=query.device), sliding_window)  # (Q, S)
    out = masked_attention(q, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0), mask, scale,
                           logit_soft_cap)
    return out[0].transpose(0, 1)
