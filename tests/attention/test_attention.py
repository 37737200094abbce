"""Paged attention (torch backend) against plain causal attention on random tensors.

Every case builds each request's full K/V, puts its first ``context_len`` tokens in a
paged cache with shuffled block tables (other slots full of large garbage), passes the
remaining ``query_len`` tokens through the backend, and compares with float64 causal
attention over the contiguous K/V (grouped-query attention by repeating KV heads).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedllm.attention import Attention, TorchPagedAttention, get_attention_backend
from pagedllm.attention.backend import set_forward_context
from tests.model_utils import allocate_block_tables, make_metadata
from tests.reference import causal_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 32
SCALE = HEAD_DIM**-0.5
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}

# (context_len, query_len): decodes first (query 1), then prefills, chunked prefills with context
MIXED = [(0, 1), (5, 1), (37, 1), (130, 1), (16, 1),
         (0, 13), (0, 1), (20, 7), (48, 16), (3, 40), (0, 64)]


def build_case(reqs, block_size, dtype, seed=0):
    """Random Q/K/V for requests [(context_len, query_len)], the cache pre-filled with each
    request's context K/V, and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    tables, num_blocks = allocate_block_tables(seq_lens, block_size, seed)
    cache = (100 * torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=g)).to(dtype)
    full_k = [torch.randn(s, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for s in seq_lens]
    full_v = [torch.randn(s, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for s in seq_lens]
    queries = [torch.randn(q, NUM_HEADS, HEAD_DIM, generator=g).to(dtype) for _, q in reqs]
    for (c, _), table, k, v in zip(reqs, tables, full_k, full_v):
        for p in range(c):  # the cached context
            cache[0, table[p // block_size], p % block_size] = k[p]
            cache[1, table[p // block_size], p % block_size] = v[p]
    meta = make_metadata([c for c, _ in reqs], [q for _, q in reqs], tables, block_size)
    query = torch.cat(queries)
    key = torch.cat([k[c:] for (c, _), k in zip(reqs, full_k)])
    value = torch.cat([v[c:] for (c, _), v in zip(reqs, full_v)])
    expected = torch.cat([causal_attention(q, k, v, c, SCALE)
                          for (c, _), q, k, v in zip(reqs, queries, full_k, full_v)])
    return query, key, value, cache, meta, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_batch_matches_causal_attention(block_size, dtype):
    query, key, value, cache, meta, expected = build_case(MIXED, block_size, dtype)
    assert meta.num_decodes == 5
    out = TorchPagedAttention().make_impl(SCALE).forward(query, key, value, cache, meta)
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("block_size", [1, 16])
def test_new_kv_written_at_slot_mapping(block_size):
    query, key, value, cache, meta, _ = build_case(MIXED, block_size, torch.float32, seed=1)
    TorchPagedAttention().make_impl(SCALE).forward(query, key, value, cache, meta)
    flat = cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(flat[0, meta.slot_mapping], key, atol=0, rtol=0)
    torch.testing.assert_close(flat[1, meta.slot_mapping], value, atol=0, rtol=0)


@pytest.mark.parametrize("reqs", [
    [(0, 1), (9, 1), (300, 1), (63, 1), (64, 1), (65, 1)],  # decode only, block edges
    [(0, 50), (17, 33), (0, 1)],  # prefill only
])
def test_decode_only_and_prefill_only(reqs):
    query, key, value, cache, meta, expected = build_case(reqs, 16, torch.float32, seed=2)
    out = TorchPagedAttention().make_impl(SCALE).forward(query, key, value, cache, meta)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.float32], rtol=0)


def test_decode_groups_when_workspace_is_capped():
    """A workspace cap smaller than one batch processes decodes in groups, same result."""
    reqs = [(c, 1) for c in (3, 70, 150, 31, 200, 16, 99)]
    query, key, value, cache, meta, expected = build_case(reqs, 16, torch.float32, seed=3)
    backend = TorchPagedAttention(max_workspace_bytes=2 * 13 * 16 * NUM_KV_HEADS * HEAD_DIM * 4 * 2)
    out = backend.make_impl(SCALE).forward(query, key, value, cache.clone(), meta)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.float32], rtol=0)
    assert backend._workspace.numel() < 7 * 2 * 13 * 16 * NUM_KV_HEADS * HEAD_DIM  # really grouped


def test_multi_query_and_mha_head_layouts():
    for num_kv in (1, NUM_HEADS):
        g = torch.Generator().manual_seed(4)
        reqs = [(10, 1), (0, 9), (5, 4)]
        tables, num_blocks = allocate_block_tables([11, 9, 9], 4)
        cache = torch.zeros(2, num_blocks, 4, num_kv, HEAD_DIM)
        k_full = [torch.randn(c + q, num_kv, HEAD_DIM, generator=g) for c, q in reqs]
        v_full = [torch.randn(c + q, num_kv, HEAD_DIM, generator=g) for c, q in reqs]
        qs = [torch.randn(q, NUM_HEADS, HEAD_DIM, generator=g) for _, q in reqs]
        for (c, _), t, k, v in zip(reqs, tables, k_full, v_full):
            for p in range(c):
                cache[:, t[p // 4], p % 4] = torch.stack([k[p], v[p]])
        meta = make_metadata([c for c, _ in reqs], [q for _, q in reqs], tables, 4)
        out = TorchPagedAttention().make_impl(SCALE).forward(
            torch.cat(qs), torch.cat([k[c:] for (c, _), k in zip(reqs, k_full)]),
            torch.cat([v[c:] for (c, _), v in zip(reqs, v_full)]), cache, meta)
        expected = torch.cat([causal_attention(q, k, v, c, SCALE) for (c, _), q, k, v in zip(reqs, qs, k_full, v_full)])
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)


def test_shape_errors_name_the_mismatch():
    query, key, value, cache, meta, _ = build_case([(0, 3)], 4, torch.float32)
    with pytest.raises(ValueError, match="kv_cache"):
        TorchPagedAttention().make_impl(SCALE).forward(query, key, value, cache[:, :, :, :1], meta)
    with pytest.raises(ValueError, match=r"\[2, num_blocks"):
        TorchPagedAttention().make_impl(SCALE).forward(query, key, value, cache[0], meta)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TorchPagedAttention().make_impl(SCALE).forward(query[:, :5], key, value, cache, meta)
    with pytest.raises(ValueError, match="max_workspace_bytes"):
        TorchPagedAttention(max_workspace_bytes=0)


def test_backend_factory():
    assert isinstance(get_attention_backend("cpu"), TorchPagedAttention)
    has_triton = importlib.util.find_spec("triton") is not None
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    cuda_default = type(get_attention_backend(torch.device("cuda"))).__name__
    assert cuda_default == ("FlashInferPagedAttention" if has_flashinfer else
                            "TritonPagedAttention" if has_triton else "TorchPagedAttention")
    with pytest.raises(ValueError, match="device type"):
        get_attention_backend("meta")
    assert isinstance(get_attention_backend("cuda", "torch"), TorchPagedAttention)  # the reference stays selectable
    if not has_triton:
        with pytest.raises(ValueError, match="needs the triton package"):
            get_attention_backend("cpu", "triton")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_attention_backend("cpu", "flashinfer")
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("cpu", "xformers")


def test_attention_layer_without_metadata_is_one_causal_sequence():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(12, NUM_HEADS, HEAD_DIM, generator=g)
    k = torch.randn(12, NUM_KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(12, NUM_KV_HEADS, HEAD_DIM, generator=g)
    layer = Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SCALE, TorchPagedAttention())
    with set_forward_context(None):
        out = layer(q, k, v)
    torch.testing.assert_close(out.double(), causal_attention(q, k, v, 0, SCALE), atol=2e-5, rtol=0)
    meta = make_metadata([0], [12], [[0, 1, 2]], 4)
    with set_forward_context(meta), pytest.raises(RuntimeError, match="bind_kv_caches"):
        layer(q, k, v)
    with pytest.raises(ValueError, match="multiple of"):
        Attention(6, 4, HEAD_DIM, SCALE, TorchPagedAttention())


def test_decode_plan_is_per_forward_pass_not_per_metadata_object():
    """Layers of one pass share the decode plan; a runner that refills one metadata object
    in place for the next step must not get the previous step's plan."""
    backend = TorchPagedAttention()
    first = build_case([(40, 1), (7, 1)], 16, torch.float32, seed=6)
    second = build_case([(3, 1), (90, 1)], 16, torch.float32, seed=7)
    meta = first[4]
    with set_forward_context(meta):
        for _ in range(2):  # two "layers" (the second writes the same K/V again: harmless)
            out = backend.make_impl(SCALE).forward(*first[:3], first[3], meta)
            torch.testing.assert_close(out.double(), first[5], atol=2e-5, rtol=0)
    for field in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables", "max_seq_len",
                  "query_start_loc_cpu", "seq_lens_cpu"):
        setattr(meta, field, getattr(second[4], field))  # the same object, refilled
    with set_forward_context(meta):
        out = backend.make_impl(SCALE).forward(*second[:3], second[3], meta)
    torch.testing.assert_close(out.double(), second[5], atol=2e-5, rtol=0)


def test_cpu_prefill_uses_fused_flash_attention_not_the_math_path():
    """Chunked prefill over cached context (and a fresh prompt) runs SDPA's fused CPU kernel:
    the math path materializes a (query x key) score matrix per head, which at thousands of
    tokens costs gigabytes and most of the prefill time."""
    query, key, value, cache, meta, expected = build_case([(0, 40), (300, 64), (17, 33)], 16, torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = TorchPagedAttention().make_impl(SCALE).forward(query, key, value, cache, meta)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_attention_math" not in ops
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.float32], rtol=0)


def test_log_sum_exp_merge_equals_one_softmax():
    """The torch backend's CPU chunked prefill: attention over the cached prefix and causal
    attention over the chunk, merged by their log-sum-exps, equals one softmax over the union
    (float64 reference with the bottom-right causal mask), GQA included."""
    from pagedllm.attention.torch_paged import _prefix_chunk_attention
    g = torch.Generator().manual_seed(11)
    num_context, num_queries, num_heads, num_kv_heads, head_dim = 150, 37, 6, 2, 32
    q = 3 * torch.randn(num_queries, num_heads, head_dim, generator=g)
    k, v = torch.randn(2, num_context + num_queries, num_kv_heads, head_dim, generator=g)
    out = _prefix_chunk_attention(q.transpose(0, 1).unsqueeze(0), k[:num_context], v[:num_context],
                                  k[num_context:], v[num_context:], head_dim**-0.5)
    kk, vv = (x.double().repeat_interleave(num_heads // num_kv_heads, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * head_dim**-0.5
    query_pos = torch.arange(num_context, num_context + num_queries).unsqueeze(1)
    hidden = torch.arange(num_context + num_queries).unsqueeze(0) > query_pos  # (Q, S): key after the query
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
