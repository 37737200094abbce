"""The Triton attention backend: the CUDA default (also runs on CPU under ``TRITON_INTERPRET=1``).

Per layer and step it launches:

1. the KV write (:func:`~pagedllm.attention.triton_kv_write.write_kv_cache_triton`), then
2. either the unified varlen kernel with query tiles for the whole mixed batch
   (:mod:`pagedllm.attention.triton_unified`: prefill, chunked prefill with cached context and
   decode in one launch), or, for a decode-only batch too small to fill the GPU with one
   program per (request, KV head) and with long enough contexts, the split-KV
   (flash-decoding) kernels (:mod:`pagedllm.attention.triton_split_kv`).

Every choice depends on host-side numbers of the metadata only (request count, longest
query, longest context), never on device values, so a step is sync-free and a decode batch
can be captured in a CUDA graph (:meth:`TritonPagedAttention.supports_cuda_graphs`).
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionMetadata, check_shapes
from pagedllm.attention.triton_kv_write import write_kv_cache_triton
from pagedllm.attention.triton_split_kv import choose_num_splits, split_kv_decode
from pagedllm.attention.triton_unified import unified_attention


class TritonPagedAttention:
    """The :class:`~pagedllm.attention.backend.AttentionBackend` as Triton kernels.

    Same contract as :class:`~pagedllm.attention.torch_paged.TorchPagedAttention`:
    query (T, num_heads, head_dim), key/value (T, num_kv_heads, head_dim), kv_cache
    (2, num_blocks, block_size, num_kv_heads, head_dim) written in place; returns
    (T, num_heads, head_dim) in the query dtype. Raises ValueError on layout mismatches.

    Args:
        split_kv_max_programs: use split-KV for a decode-only batch when requests × KV heads
            is below this (about the SM count of a large GPU: fewer programs leave SMs idle).
        split_kv_min_seq_len: ... and its longest context has at least this many tokens
            (shorter contexts gain less than the extra reduction launch costs).
    """

    supports_cuda_graphs = True  # no host sync, launch shapes from host-side batch sizes only
    supports_quantized_kv = True  # fp8 and int8 caches (kv_scales), pagedllm.attention.triton_kv_dtype

    def __init__(self, split_kv_max_programs: int = 128, split_kv_min_seq_len: int = 512) -> None:
        self.split_kv_max_programs = split_kv_max_programs
        self.split_kv_min_seq_len = split_kv_min_seq_len

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float, *,
                sliding_window: int | None = None, logit_soft_cap: float | None = None,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Write this step's K/V and return causal attention per request.

        ``sliding_window``: a query at position i sees keys j with i - j < sliding_window
        (None = all); ``logit_soft_cap``: scores become cap × tanh(scores / cap) (None = off).
        The cache may hold any ``kv_cache_dtype``: float8 is written and read as vLLM's
        per-tensor-scaled codes, int8 with ``kv_scales`` (2, num_blocks, block_size,
        num_kv_heads) float32, one scale per token and KV head (ValueError without them).
        """
        check_shapes(query, key, kv_cache)
        write_kv_cache_triton(key, value, kv_cache, metadata.slot_mapping, kv_scales)
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if query.shape[0] == 0:
            return out
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        num_splits = self.num_splits(metadata, kv_cache)
        if num_splits > 1:
            split_kv_decode(query, key_cache, value_cache, out, metadata.block_tables, metadata.seq_lens,
                            metadata.query_start_loc, num_splits, scale, sliding_window, logit_soft_cap, kv_scales)
        else:
            unified_attention(query, key_cache, value_cache, out, metadata.block_tables, metadata.seq_lens,
                              metadata.query_start_loc, metadata.max_query_len, scale, sliding_window,
                              logit_soft_cap, kv_scales)
        return out

    __call__ = forward

    def num_splits(self, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> int:
        """Key splits for this batch: > 1 selects split-KV decode, 1 the unified kernel."""
        num_reqs, num_kv_heads, block_size = metadata.num_reqs, kv_cache.shape[3], kv_cache.shape[2]
        if (metadata.num_decodes != num_reqs or num_reqs * num_kv_heads >= self.split_kv_max_programs
                or metadata.max_seq_len < self.split_kv_min_seq_len):
            return 1
        return choose_num_splits(num_reqs, num_kv_heads, metadata.max_seq_len, block_size)
