"""FlashInfer attention backend (optional: ``pip install pagedllm[flashinfer]``, CUDA only).

FlashInfer (Ye et al., 2025, "FlashInfer: Efficient and Customizable Attention Engine for LLM
Inference Serving") reads a paged KV cache through a CSR page table: for request b its pages
are ``paged_kv_indices[paged_kv_indptr[b]:paged_kv_indptr[b+1]]`` and its last page holds
``paged_kv_last_page_len[b]`` tokens. The engine's cache layout
``(2, num_blocks, block_size, num_kv_heads, head_dim)`` is FlashInfer's ``"NHD"`` layout with
K and V as two tensors, so no copy is needed; a block is a FlashInfer page.

Per forward pass (and KV-cache group, and layer options such as a sliding window) the
backend converts the step's block tables to CSR once (on the host lists the metadata
carries, one gather on the device) and calls ``plan`` of two documented wrappers, shared by
the layers with the same group and options:

- ``BatchDecodeWithPagedKVCacheWrapper`` for the leading decode requests,
- ``BatchPrefillWithPagedKVCacheWrapper`` (``causal=True``) for prefills and chunked
  prefills with cached context (FlashInfer aligns the causal mask bottom-right: the query
  rows are the last tokens of each request).

New K/V are written with :func:`~pagedllm.attention.backend.write_kv_cache` first.
Sliding window maps to FlashInfer's ``window_left = sliding_window - 1``, the soft-cap to
``logits_soft_cap``. Not used inside CUDA graphs (``supports_cuda_graphs = False``): its
plan runs on the host each step.

KV caches in the model dtype or bfloat16 only (``supports_quantized_kv = False``): FlashInfer has
no int8 KV cache with per token-and-head scales, and its float8 paths are not exercised here, so
the model runner refuses ``kv_cache_dtype`` fp8/int8 with this backend (use the Triton one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.backend import (AttentionMetadata, ForwardContext, check_shapes, get_forward_context,
                                        write_kv_cache)
from pagedllm.utils import cdiv

_WORKSPACE_BYTES = 256 * 1024**2


@dataclass
class PagedCSR:
    """FlashInfer's page-table form of some requests' block tables (int32)."""

    indptr: torch.Tensor  # (n + 1,) pages of request b are indices[indptr[b]:indptr[b+1]]
    indices: torch.Tensor  # (total pages,) physical block ids
    last_page_len: torch.Tensor  # (n,) tokens in each request's last block, 1..block_size


def block_tables_to_csr(block_tables: torch.Tensor, seq_lens: list[int], block_size: int) -> PagedCSR:
    """CSR page table of requests with ``seq_lens`` tokens (no device sync: host lists only).

    Args:
        block_tables: (n, max_blocks) int32 on the device; row b's first
            ceil(seq_lens[b] / block_size) entries are used.
        seq_lens: n host ints, each >= 1.
    Returns:
        :class:`PagedCSR` with indptr/last_page_len on the host (FlashInfer's ``plan`` reads
        them there) and indices on the block tables' device.
    """
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


class FlashInferPagedAttention:
    """The :class:`~pagedllm.attention.backend.AttentionBackend` on FlashInfer's paged wrappers.

    Same contract as :class:`~pagedllm.attention.torch_paged.TorchPagedAttention`. One
    instance is shared by every layer of a model; it re-plans when a new forward pass
    (a new ``set_forward_context``) or a different layer option arrives.
    Raises ImportError (at construction) without flashinfer, ValueError on layout mismatches.
    """

    supports_cuda_graphs = False
    supports_quantized_kv = False  # no int8 KV with per-token scales (see the module docstring)

    def __init__(self, workspace_bytes: int = _WORKSPACE_BYTES) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self._workspace_bytes = workspace_bytes
        self._workspace: torch.Tensor | None = None
        self._wrappers: list[tuple] = []  # (decode, prefill) pairs, reused from pass to pass
        self._pass: ForwardContext | None = None  # the forward pass the plans below belong to
        self._plans: dict[tuple, int] = {}  # (id(metadata), layer options) -> index into _wrappers

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float, *,
                sliding_window: int | None = None, logit_soft_cap: float | None = None) -> torch.Tensor:
        """Write this step's K/V, then decode and prefill attention through FlashInfer."""
        check_shapes(query, key, kv_cache)
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        decode, prefill = self._planned(metadata, kv_cache, query.shape[1], query.dtype, scale, sliding_window,
                                        logit_soft_cap)
        caches = (kv_cache[0], kv_cache[1])  # each (num_blocks, block_size, num_kv_heads, head_dim): NHD
        nd = metadata.num_decode_tokens
        if nd:
            out[:nd] = decode.run(query[:nd], caches)
        if nd < query.shape[0]:
            out[nd:] = prefill.run(query[nd:], caches)
        return out

    __call__ = forward

    def _planned(self, metadata: AttentionMetadata, kv_cache: torch.Tensor, num_heads: int, q_dtype: torch.dtype,
                 scale: float, sliding_window: int | None, logit_soft_cap: float | None) -> tuple:
        """A (decode, prefill) wrapper pair planned for this metadata (a KV-cache group's) and
        these layer options: planned once per forward pass, as FlashInfer requires before ``run``."""
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        owner = _pass_of(metadata)
        if owner is None or owner is not self._pass:
            self._pass, self._plans = owner, {}
        key = (id(metadata), num_heads, q_dtype, kv_cache.dtype, scale, sliding_window, logit_soft_cap, block_size)
        if owner is not None and key in self._plans:
            return self._wrappers[self._plans[key]]
        index = len(self._plans)
        decode, prefill = self._wrapper_pair(index, kv_cache.device)
        nd, nreq = metadata.num_decodes, metadata.num_reqs
        common = dict(window_left=-1 if sliding_window is None else sliding_window - 1,
                      logits_soft_cap=logit_soft_cap, sm_scale=scale, q_data_type=q_dtype,
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
        """The index-th (decode, prefill) wrapper pair (created on first use; all share one workspace)."""
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
