"""FlashInfer backend: the CSR page table on CPU; the kernels against plain attention on CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedllm.attention.flashinfer_paged import block_tables_to_csr

needs_flashinfer = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
                                      reason="FlashInfer runs on CUDA only and needs pagedllm[flashinfer]")


def test_block_tables_to_csr():
    tables = torch.tensor([[7, 3, 9], [4, 0, 0], [1, 2, 0]], dtype=torch.int32)
    csr = block_tables_to_csr(tables, [33, 16, 17], 16)
    assert csr.indptr.tolist() == [0, 3, 4, 6]
    assert csr.indices.tolist() == [7, 3, 9, 4, 1, 2]
    assert csr.last_page_len.tolist() == [1, 16, 1]
    assert csr.indptr.dtype == csr.indices.dtype == csr.last_page_len.dtype == torch.int32


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("window,softcap", [(None, None), (24, 30.0)])
def test_flashinfer_mixed_batch_matches_reference(window, softcap):
    from pagedllm.attention.flashinfer_paged import FlashInferPagedAttention
    from tests.attention.test_triton_attention import MIXED, build, check

    query, key, value, cache, meta, expected, scale = build(
        MIXED, num_kv_heads=2, group=4, head_dim=128, dtype=torch.bfloat16, window=window, softcap=softcap)
    impl = FlashInferPagedAttention().make_impl(scale, sliding_window=window, logit_soft_cap=softcap)
    out = impl.forward(query, key, value, cache, meta)
    check(out, expected, torch.bfloat16)
