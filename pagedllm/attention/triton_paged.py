"""The Triton attention backend (the CUDA default; on CPU under ``TRITON_INTERPRET=1``): the KV write,
then the unified varlen kernel, or split-KV decoding for a small decode-only batch with long contexts.
Every choice reads host-side sizes only, so a step is CUDA-graph capturable."""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata
from pagedllm.attention.triton_kv_write import write_kv_cache_triton
from pagedllm.attention.triton_split_kv import choose_num_splits, split_kv_decode
from pagedllm.attention.triton_unified import unified_attention


class TritonPagedAttentionImpl(AttentionImpl):
    """One layer on :class:`TritonPagedAttention`; any ``kv_cache_dtype`` (int8 needs ``kv_scales``: ValueError)."""

    backend: TritonPagedAttention

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None) -> None:
        write_kv_cache_triton(key, value, kv_cache, slot_mapping, kv_scales)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, kv_scales: torch.Tensor | None) -> torch.Tensor:
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if query.shape[0] == 0:
            return out
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        batch = (metadata.block_tables, metadata.seq_lens, metadata.query_start_loc)
        options = (self.scale, self.sliding_window, self.logit_soft_cap, kv_scales)
        num_splits = self.backend.num_splits(metadata, kv_cache)
        if num_splits > 1:
            split_kv_decode(query, key_cache, value_cache, out, *batch, num_splits, *options)
        else:
            unified_attention(query, key_cache, value_cache, out, *batch, metadata.max_query_len, *options)
        return out


class TritonPagedAttention(AttentionBackend):
    """Paged attention as Triton kernels; split-KV for a decode-only batch when requests x KV heads is below
    ``split_kv_max_programs`` and its longest context has at least ``split_kv_min_seq_len`` tokens."""

    impl_cls = TritonPagedAttentionImpl
    supports_cuda_graphs = True
    supports_quantized_kv = True

    def __init__(self, split_kv_max_programs: int = 128, split_kv_min_seq_len: int = 512) -> None:
        self.split_kv_max_programs = split_kv_max_programs
        self.split_kv_min_seq_len = split_kv_min_seq_len

    def num_splits(self, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> int:
        """Key splits for this batch: > 1 selects split-KV decode, 1 the unified kernel."""
        num_reqs, num_kv_heads, block_size = metadata.num_reqs, kv_cache.shape[3], kv_cache.shape[2]
        if (metadata.num_decodes != num_reqs or num_reqs * num_kv_heads >= self.split_kv_max_programs
                or metadata.max_seq_len < self.split_kv_min_seq_len):
            return 1
        return choose_num_splits(num_reqs, num_kv_heads, metadata.max_seq_len, block_size)
