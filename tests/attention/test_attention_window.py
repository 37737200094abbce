"""Sliding-window attention and attention-logit soft-capping in every paged backend.

Each backend (torch reference, the CPU C kernel, Triton under its interpreter when installed)
is compared with float64 attention over contiguous K/V with the transformers mask: the
token at position p sees keys p - W < k <= p. Block-table entries wholly before a request's
window are set to an invalid block id, so a backend that reads them fails.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from pagedllm.attention import Attention, CpuPagedAttention, TorchPagedAttention
from pagedllm.attention.backend import set_forward_context
from tests.reference import causal_attention
from tests.attention.test_attention import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, SCALE, build_case

# (context_len, query_len): decodes (several past the window), then prefills and chunked prefills
MIXED = [(0, 1), (5, 1), (37, 1), (130, 1), (16, 1), (0, 13), (20, 7), (48, 16), (3, 40), (0, 64)]
WINDOWS = [None, 1, 8, 16, 33]


def windowed_case(reqs, block_size, window, soft_cap, dtype=torch.float32, seed=0):
    query, key, value, cache, meta, _ = build_case(reqs, block_size, dtype, seed)
    # rebuild the expectation with window / soft cap from the same tensors
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    torch.randn(cache.shape, generator=g)  # same draws as build_case
    full_k = [torch.randn(s, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for s in seq_lens]
    full_v = [torch.randn(s, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for s in seq_lens]
    queries = [torch.randn(q, NUM_HEADS, HEAD_DIM, generator=g).to(dtype) for _, q in reqs]
    assert torch.equal(torch.cat(queries), query)
    expected = torch.cat([causal_attention(q, k, v, c, SCALE, window, soft_cap)
                          for (c, _), q, k, v in zip(reqs, queries, full_k, full_v)])
    return query, key, value, cache, meta, expected


def poison_blocks_before_window(meta, reqs, block_size, window, num_blocks):
    """Entries of blocks no query token of the request can see -> an id outside the cache."""
    if window is None:
        return
    for b, (c, _) in enumerate(reqs):
        first_visible = max(0, c - window + 1)
        meta.block_tables[b, :first_visible // block_size] = num_blocks + 1000


BACKENDS = {"torch": TorchPagedAttention}


def _cpu_backend():
    backend = CpuPagedAttention()
    if not backend.is_kernel_available:
        pytest.skip("no C compiler for the CPU kernel")
    return backend


@pytest.mark.parametrize("soft_cap", [None, 5.0])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_window_and_soft_cap_match_reference(backend_name, block_size, window, soft_cap):
    query, key, value, cache, meta, expected = windowed_case(MIXED, block_size, window, soft_cap)
    if backend_name == "torch":
        backend = TorchPagedAttention()
        poison_blocks_before_window(meta, MIXED, block_size, window, cache.shape[1])
    else:
        backend = _cpu_backend()  # validates every table entry up to seq_len, so no poisoning
    with set_forward_context(meta):
        impl = backend.make_impl(SCALE, sliding_window=window, logit_soft_cap=soft_cap)
        out = impl.forward(query, key, value, cache, meta)
    torch.testing.assert_close(out.double(), expected, atol=3e-5, rtol=0)


def test_layers_with_different_windows_share_one_pass():
    """Full and windowed layers in one forward pass each get their own decode plan."""
    backend = TorchPagedAttention()
    for window in (None, 8, None, 8, 33):
        query, key, value, cache, meta, expected = windowed_case(MIXED, 16, window, None, seed=3)
        with set_forward_context(meta):
            out = backend.make_impl(SCALE, sliding_window=window).forward(query, key, value, cache, meta)
        torch.testing.assert_close(out.double(), expected, atol=3e-5, rtol=0)


@pytest.mark.parametrize("soft_cap", [None, 3.0])
def test_profiling_path_honours_window_and_soft_cap(soft_cap):
    """With no step metadata (memory profiling) the layer is one causal sequence, same mask."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(40, NUM_HEADS, HEAD_DIM, generator=g)
    k = torch.randn(40, NUM_KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(40, NUM_KV_HEADS, HEAD_DIM, generator=g)
    layer = Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SCALE, TorchPagedAttention(), sliding_window=8,
                      logit_soft_cap=soft_cap)
    with set_forward_context(None):
        out = layer(q, k, v)
    torch.testing.assert_close(out.double(), causal_attention(q, k, v, 0, SCALE, 8, soft_cap), atol=3e-5, rtol=0)


def test_bad_window_rejected():
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SCALE, TorchPagedAttention(), sliding_window=0)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("window, soft_cap", [(8, None), (None, 5.0), (16, 5.0)])
def test_triton_window_and_soft_cap(monkeypatch, window, soft_cap):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from pagedllm.attention.triton_paged import TritonPagedAttention

    query, key, value, cache, meta, expected = windowed_case(MIXED[:8], 16, window, soft_cap)
    poison_blocks_before_window(meta, MIXED[:8], 16, window, cache.shape[1])
    impl = TritonPagedAttention().make_impl(SCALE, sliding_window=window, logit_soft_cap=soft_cap)
    out = impl.forward(query, key, value, cache, meta)
    torch.testing.assert_close(out.double(), expected, atol=3e-5, rtol=0)
