"""FlashInfer attention backend (optional, CUDA only; Ye et al., 2025). The engine's cache is its ``"NHD"``
layout, a block a page; per forward pass, KV-cache group and layer options the block tables become CSR
once and a decode and a prefill wrapper are planned. Float caches only; no CUDA graphs (plans run on the host)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadata, ForwardContext,
                                        get_forward_context)
from pagedllm.utils import cdiv

_WORKSPACE_BYTES = 256 * 1024**2


@dataclass
class PagedCSR:
    """FlashInfer's page-table form of some requests' block tables (int32)."""

    indptr: torch.Tensor  # (n + 1,) pages of request b are indices[indptr[b]:indptr[b+1]]
    indices: torch.Tensor  # (total pages,) physical block ids
    last_page_len: torch.Tensor  # (n,) 1..block_size


def block_tables_to_csr(block_tables: torch.Tensor, seq_lens: list[int], block_size: int) -> PagedCSR:
    """The CSR page table of block tables (n, max_blocks) int32 for ``seq_lens`` (n host ints >= 1), without
    a device sync: indptr and last_page_len on the host, indices on the tables' device."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    num_pages = cdiv(lens, block_size)
    indptr = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(num_pages, out=indptr[1:])
    rows = np.repeat(np.arange(len(lens)), num_pages)
    cols = np.arange(indptr[-1]) - indptr[rows]
    flat = torch.from_numpy(rows * block_tables.shape[1] + cols).to(block_tables.device)
    indices = block_tables.reshape(-1).index_select(0, flat).to(torch.int32)
    last = lens - (num_pages - 1) * block_size
    return PagedCSR(torch.from_numpy(indptr.astype(np.int32)), indices, torch.from_numpy(last.astype(np.int32)))


class FlashInferPagedAttentionImpl(AttentionImpl):
    """One layer on :class:`FlashInferPagedAttention` (float caches: no ``kv_scales``)."""

    backend: FlashInferPagedAttention

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, kv_scales: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty_like(query)
        decode, prefill = self.backend.planned(self, metadata, kv_cache, query.shape[1], query.dtype)
        caches = (kv_cache[0], kv_cache[1])
        nd = metadata.num_decode_tokens
        if nd:
            out[:nd] = decode.run(query[:nd], caches)
        if nd < query.shape[0]:
            out[nd:] = prefill.run(query[nd:], caches)
        return out


class FlashInferPagedAttention(AttentionBackend):
    """FlashInfer's paged wrappers, re-planned per forward pass or layer option. Raises ImportError without
    flashinfer."""

    impl_cls = FlashInferPagedAttentionImpl

    def __init__(self, workspace_bytes: int = _WORKSPACE_BYTES) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self._workspace_bytes = workspace_bytes
        self._workspace: torch.Tensor | None = None
        self._wrappers: list[tuple] = []  # (decode, prefill) pairs, reused from pass to pass
        self._pass: ForwardContext | None = None
        self._plans: dict[tuple, int] = {}  # (id(metadata), layer options) -> index into _wrappers

    def planned(self, impl: AttentionImpl, metadata: AttentionMetadata, kv_cache: torch.Tensor, num_heads: int,
                q_dtype: torch.dtype) -> tuple:
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        owner = _pass_of(metadata)
        if owner is None or owner is not self._pass:
            self._pass, self._plans = owner, {}
        key = (id(metadata), num_heads, q_dtype, kv_cache.dtype, *impl.options, block_size)
        if owner is not None and key in self._plans:
            return self._wrappers[self._plans[key]]
        index = len(self._plans)
        decode, prefill = self._wrapper_pair(index, kv_cache.device)
        nd, nreq = metadata.num_decodes, metadata.num_reqs
        common = dict(window_left=-1 if impl.sliding_window is None else impl.sliding_window - 1,
                      logits_soft_cap=impl.logit_soft_cap, sm_scale=impl.scale, q_data_type=q_dtype,
                      kv_data_type=kv_cache.dtype)
        if nd:
            csr = block_tables_to_csr(metadata.block_tables[:nd], metadata.seq_lens_cpu[:nd], block_size)
            decode.plan(csr.indptr, csr.indices, csr.last_page_len, num_heads, num_kv_heads, head_dim,
                        block_size, **common)
        if nd < nreq:
            csr = block_tables_to_csr(metadata.block_tables[nd:], metadata.seq_lens_cpu[nd:], block_size)
            qsl = metadata.query_start_loc_cpu[nd:]
            qo_indptr = torch.tensor([q - qsl[0] for q in qsl], dtype=torch.int32)
            prefill.plan(qo_indptr, csr.indptr, csr.indices, csr.last_page_len, num_heads, num_kv_heads,
                         head_dim, block_size, causal=True, **common)
        if owner is not None:
            self._plans[key] = index
        return decode, prefill

    def _wrapper_pair(self, index: int, device: torch.device) -> tuple:
        """The index-th (decode, prefill) wrapper pair (all share one workspace)."""
        if self._workspace is None or self._workspace.device != device:
            self._workspace = torch.zeros(self._workspace_bytes, dtype=torch.uint8, device=device)
            self._wrappers = []
        while len(self._wrappers) <= index:
            fi = self._flashinfer
            self._wrappers.append((fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=True),
                                   fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")))
        return self._wrappers[index]


def _pass_of(metadata: AttentionMetadata) -> ForwardContext | None:
    """The active forward context if ``metadata`` is one of its KV-cache groups' metadata, else None."""
    try:
        ctx = get_forward_context()
    except RuntimeError:
        return None
    groups = getattr(ctx, "group_metadata", ()) or (ctx.attn_metadata,)
    return ctx if any(m is metadata for m in groups) else None
