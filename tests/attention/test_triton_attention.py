"""Triton attention kernels against plain float64 attention, under the Triton interpreter on CPU.

Each case puts every request's cached context into a shuffled paged cache (other slots full
of large garbage, one of them NaN), runs a kernel for a ragged batch mixing decodes,
prefills and chunked prefills with cached context, and compares with causal attention over
the contiguous K/V (GQA by repeating KV heads, sliding window and logit soft-cap applied the
way Hugging Face's Mistral/Gemma 2 do). Tolerances: float32 1e-4, bfloat16/float16 2e-2. Quantized
KV caches (fp8, int8) are checked against the attention over the K/V as stored and, through
it, against the float attention within the rounding's computed bound.

On a CUDA machine the same tests run on the GPU (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET=1 must be set before triton kernels are imported (tests/conftest.py does)",
                allow_module_level=True)

from pagedllm.attention.triton_kv_write import write_kv_cache_triton  # noqa: E402
from pagedllm.attention.triton_paged import TritonPagedAttention  # noqa: E402
from pagedllm.attention.triton_split_kv import choose_num_splits, split_kv_decode  # noqa: E402
from pagedllm.attention.triton_unified import find_seq_idx, tile_shape, unified_attention  # noqa: E402,F401
from pagedllm.attention.backend import write_kv_cache  # noqa: E402
from pagedllm.quantization.kv_cache import dequantize_kv, quantize_kv, resolve_kv_cache_dtype  # noqa: E402
from tests.model_utils import allocate_block_tables, kv_rounding_error_bound, make_metadata  # noqa: E402
from tests.reference import causal_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}

# (context_len, query_len): decodes first, then a prefill, chunked prefills with context
MIXED = [(0, 1), (17, 1), (70, 1), (0, 21), (33, 5), (40, 18)]
DECODES = [(0, 1), (15, 1), (95, 1), (200, 1)]


def build(reqs, *, num_kv_heads=2, group=3, head_dim=64, block_size=16, dtype=torch.float32,
          window=None, softcap=None, seed=0):
    """(query, key, value, kv_cache, metadata, expected) for requests [(context_len, query_len)]."""
    g = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    seq_lens = [c + n for c, n in reqs]
    tables, num_blocks = allocate_block_tables(seq_lens, block_size, seed)
    cache = (50 * torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)).to(dtype)
    cache[:, tables[0][0], -1] = float("nan")  # stale slots past a seq_len must never leak in
    full_k = [torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype) for s in seq_lens]
    full_v = [torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype) for s in seq_lens]
    queries = [torch.randn(n, num_heads, head_dim, generator=g).to(dtype) for _, n in reqs]
    for (c, _), table, k, v in zip(reqs, tables, full_k, full_v):
        for p in range(c):
            cache[0, table[p // block_size], p % block_size] = k[p]
            cache[1, table[p // block_size], p % block_size] = v[p]
    meta = make_metadata([c for c, _ in reqs], [n for _, n in reqs], tables, block_size, DEVICE)
    scale = head_dim**-0.5
    expected = torch.cat([causal_attention(q, k, v, c, scale, window, softcap)
                          for (c, _), q, k, v in zip(reqs, queries, full_k, full_v)])
    key = torch.cat([k[c:] for (c, _), k in zip(reqs, full_k)])
    value = torch.cat([v[c:] for (c, _), v in zip(reqs, full_v)])
    return (torch.cat(queries).to(DEVICE), key.to(DEVICE), value.to(DEVICE), cache.to(DEVICE), meta,
            expected, scale)


def run_unified(case, window=None, softcap=None):
    query, key, value, cache, meta, expected, scale = case
    write_kv_cache_triton(key, value, cache, meta.slot_mapping)
    out = torch.full_like(query, float("nan"))
    unified_attention(query, cache[0], cache[1], out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                      meta.max_query_len, scale, window, softcap)
    return out


def run_split(case, num_splits, window=None, softcap=None):
    query, key, value, cache, meta, expected, scale = case
    write_kv_cache_triton(key, value, cache, meta.slot_mapping)
    out = torch.full_like(query, float("nan"))
    split_kv_decode(query, cache[0], cache[1], out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                    num_splits, scale, window, softcap)
    return out


def check(out, expected, dtype):
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu().double(), expected, atol=TOLERANCE[dtype], rtol=0)


# -- unified kernel ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,block_size,group,head_dim", [
    (torch.float32, 16, 3, 64),
    (torch.bfloat16, 32, 8, 128),
    (torch.float16, 16, 1, 256),
])
def test_unified_mixed_batch(dtype, block_size, group, head_dim):
    case = build(MIXED, num_kv_heads=1 if head_dim == 256 else 2, group=group, head_dim=head_dim,
                 block_size=block_size, dtype=dtype)
    check(run_unified(case), case[5], dtype)


def stale_out_of_window_blocks(case, reqs, block_size, window):
    """Block-table entries wholly before every query's window may be stale (a sliding-window
    KV group frees them): point them at an unused block full of NaN, which must never be read."""
    cache, meta = case[3], case[4]
    unused = sorted(set(range(cache.shape[1])) - set(meta.block_tables.flatten().tolist()))[0]
    cache[:, unused] = float("nan")
    for b, (c, _) in enumerate(reqs):
        meta.block_tables[b, :max(0, c - window + 1) // block_size] = unused


@pytest.mark.parametrize("window,softcap", [(8, None), (None, 5.0), (20, 30.0)])
def test_unified_sliding_window_and_soft_cap(window, softcap):
    case = build(MIXED, window=window, softcap=softcap, block_size=4, seed=1)  # 4: a key tile spans 8 blocks
    if window is not None:
        stale_out_of_window_blocks(case, MIXED, 4, window)
    check(run_unified(case, window, softcap), case[5], torch.float32)


def test_unified_decode_only_and_small_block():
    """Decode-only batches take one-token tiles; block size 4 (< the 32-key tile) still works."""
    case = build(DECODES, block_size=4, seed=2)
    assert tile_shape(3, 1) == (16, 5) and tile_shape(3, 21) == (64, 21)
    check(run_unified(case), case[5], torch.float32)


def test_unified_writes_only_real_rows_and_handles_empty_batch():
    query, key, value, cache, meta, expected, scale = build([(3, 2), (0, 4)], seed=3)
    write_kv_cache_triton(key, value, cache, meta.slot_mapping)
    out = torch.full((query.shape[0] + 3, *query.shape[1:]), 7.0, device=DEVICE)  # 3 rows past the batch
    unified_attention(query, cache[0], cache[1], out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                      meta.max_query_len, scale)
    check(out[:-3], expected, torch.float32)
    assert (out[-3:] == 7.0).all()
    unified_attention(query[:0], cache[0], cache[1], out[:0], meta.block_tables[:0], meta.seq_lens[:0],
                      meta.query_start_loc[:1], 0, scale)  # nothing to do, no launch


def test_bad_options_raise_value_error():
    query, key, value, cache, meta, expected, scale = build([(0, 2)])
    with pytest.raises(ValueError, match="sliding_window"):
        unified_attention(query, cache[0], cache[1], query, meta.block_tables, meta.seq_lens,
                          meta.query_start_loc, 2, scale, sliding_window=0)
    with pytest.raises(ValueError, match="logit_soft_cap"):
        split_kv_decode(query, cache[0], cache[1], query, meta.block_tables, meta.seq_lens,
                        meta.query_start_loc, 2, scale, logit_soft_cap=-1.0)
    with pytest.raises(ValueError, match="num_splits"):
        split_kv_decode(query, cache[0], cache[1], query, meta.block_tables, meta.seq_lens,
                        meta.query_start_loc, 0, scale)


# -- split-KV decode ----------------------------------------------------------------------------

@pytest.mark.parametrize("num_splits,window,softcap", [(1, None, None), (4, None, None), (8, 24, 10.0)])
def test_split_kv_decode(num_splits, window, softcap):
    """Splits past a short context are empty (request 0 has one key): they must weigh nothing."""
    case = build(DECODES, num_kv_heads=2, group=4, window=window, softcap=softcap, block_size=4, seed=4)
    if window is not None:
        stale_out_of_window_blocks(case, DECODES, 4, window)
    check(run_split(case, num_splits, window, softcap), case[5], torch.float32)


def test_split_kv_decode_bf16_block32():
    case = build(DECODES, num_kv_heads=1, group=8, head_dim=128, block_size=32, dtype=torch.bfloat16, seed=5)
    check(run_split(case, 4), case[5], torch.bfloat16)


def test_choose_num_splits():
    assert choose_num_splits(1, 8, 8192, 16) == 32  # one request: as many splits as allowed
    assert choose_num_splits(16, 8, 8192, 16) == 2
    assert choose_num_splits(1, 8, 40, 16) == 2  # never more splits than key tiles (rounded up)
    assert choose_num_splits(64, 8, 8192, 16) == 1


# -- KV write -----------------------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_kv_write_strided_input_and_padding_slots(cache_dtype):
    g = torch.Generator().manual_seed(6)
    num_blocks, block_size, num_kv_heads, head_dim = 5, 16, 3, 64
    qkv = torch.randn(7, (4 + 2) * num_kv_heads * head_dim, generator=g)  # fused projection output
    key = qkv[:, 4 * num_kv_heads * head_dim:5 * num_kv_heads * head_dim].view(7, num_kv_heads, head_dim)
    value = qkv[:, 5 * num_kv_heads * head_dim:].view(7, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
    slots = torch.tensor([3, 17, -1, 79, 40, -1, 0])  # -1: padding, not written
    write_kv_cache_triton(key.to(DEVICE), value.to(DEVICE), cache_dev := cache.to(DEVICE), slots.to(DEVICE))
    flat = cache_dev.cpu().view(2, -1, num_kv_heads, head_dim)
    real = slots >= 0
    # float32 -> bfloat16: one bfloat16 ulp (the interpreter truncates, a GPU rounds to nearest)
    rtol = 0 if cache_dtype == torch.float32 else 2**-7
    torch.testing.assert_close(flat[0, slots[real]].float(), key[real].to(cache_dtype).float(), atol=0, rtol=rtol)
    torch.testing.assert_close(flat[1, slots[real]].float(), value[real].to(cache_dtype).float(), atol=0, rtol=rtol)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots[real]] = False
    assert (flat[:, untouched] == 0).all()
    with pytest.raises(ValueError, match="do not match"):
        write_kv_cache_triton(key[:, :2], value[:, :2], cache, slots)


# -- quantized KV caches (fp8 e4m3fn/e5m2 with per-tensor scale, int8 with per token-and-head scales) ----

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8"]


def build_quantized(reqs, name, *, dtype=torch.float32, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                    seed=0):
    """A case whose context sits in a cache of ``kv_cache_dtype=name``, written by the torch
    backend (the reference writer; other slots hold random codes and scales, NaN scales past a
    request's end). Returns (query, key, value, cache, kv_scales, meta, stored_ref, float_ref, bound, scale):
    the float64 attention over the K/V as stored, over the float K/V, and the rounding's bound
    between the two (:func:`kv_rounding_error_bound`), all (T, num_heads, head_dim) / (T, num_heads)."""
    spec = resolve_kv_cache_dtype(name, torch.float32)
    g = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    seq_lens = [c + n for c, n in reqs]
    tables, num_blocks = allocate_block_tables(seq_lens, block_size, seed)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8).view(spec.storage)  # random codes
    scales = None
    if spec.has_token_scales:
        scales = 10 * torch.rand(shape[:4], generator=g)
        scales[:, tables[0][0], -1] = float("nan")  # a stale slot past request 0's end
    ks = [2 * torch.randn(s, num_kv_heads, head_dim, generator=g) for s in seq_lens]
    vs = [torch.randn(s, num_kv_heads, head_dim, generator=g) for s in seq_lens]
    for k in ks:  # float8 subnormals too
        k[::5] *= 1e-3
    ks, vs = [k.to(dtype).float() for k in ks], [v.to(dtype).float() for v in vs]  # what the model computes
    qs = [torch.randn(n, num_heads, head_dim, generator=g).to(dtype).float() for _, n in reqs]
    for (c, _), table, k, v in zip(reqs, tables, ks, vs):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(c)], dtype=torch.int64)
        write_kv_cache(k[:c], v[:c], cache, slots, scales)
    scale = head_dim**-0.5
    stored, floats, bounds = [], [], []
    for (c, _), q, k, v in zip(reqs, qs, ks, vs):
        k2, v2 = (dequantize_kv(*quantize_kv(x, spec.storage), torch.float32) for x in (k, v))
        stored.append(causal_attention(q.to(dtype), k2, v2, c, scale))
        floats.append(causal_attention(q.to(dtype), k, v, c, scale))
        bounds.append(kv_rounding_error_bound(q, k, v, k2, v2, scale))
    meta = make_metadata([c for c, _ in reqs], [n for _, n in reqs], tables, block_size, DEVICE)
    key = torch.cat([k[c:] for (c, _), k in zip(reqs, ks)]).to(dtype)
    value = torch.cat([v[c:] for (c, _), v in zip(reqs, vs)]).to(dtype)
    return (torch.cat(qs).to(dtype).to(DEVICE), key.to(DEVICE), value.to(DEVICE), cache.to(DEVICE),
            None if scales is None else scales.to(DEVICE), meta, torch.cat(stored), torch.cat(floats),
            torch.cat(bounds), scale)


def check_quantized(out, stored_ref, float_ref, bound, dtype):
    """Attention over the K/V as stored (float32 1e-4; bfloat16 queries 2e-2), hence within the
    rounding's bound of the float attention."""
    out = out.cpu().double()
    assert not out.isnan().any()
    torch.testing.assert_close(out, stored_ref, atol=TOLERANCE[dtype], rtol=0)
    assert ((out - float_ref).abs().amax(-1) <= bound + TOLERANCE[dtype]).all()


@pytest.mark.parametrize("name", QUANTIZED)
def test_kv_write_quantized_equals_torch_writer(name):
    """The Triton writer stores the torch writer's codes and scales bit for bit (strided key/value
    from a fused projection, padding slots skipped, values past the format's range saturate)."""
    spec = resolve_kv_cache_dtype(name, torch.float32)
    g = torch.Generator().manual_seed(9)
    num_blocks, block_size, num_kv_heads, head_dim = 5, 16, 3, 48  # head_dim 48: a padded BLOCK_D
    qkv = 3 * torch.randn(7, 6 * num_kv_heads * head_dim, generator=g)
    qkv[:, ::11] *= 1e-4  # float8 subnormals
    qkv[2, 0] = 1e6  # saturates
    key = qkv[:, 4 * num_kv_heads * head_dim:5 * num_kv_heads * head_dim].view(7, num_kv_heads, head_dim)
    value = qkv[:, 5 * num_kv_heads * head_dim:].view(7, num_kv_heads, head_dim)
    value[1, 2] = 0.0  # an all-zero head: int8 scale 1
    slots = torch.tensor([3, 17, -1, 79, 40, -1, 0])  # -1: padding, not written
    real = slots >= 0
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    ref_cache = torch.zeros(shape, dtype=spec.storage)
    ref_scales = torch.ones(shape[:4]) if spec.has_token_scales else None
    write_kv_cache(key[real], value[real], ref_cache, slots[real], ref_scales)
    cache = torch.zeros(shape, dtype=spec.storage, device=DEVICE)
    scales = torch.ones(shape[:4], device=DEVICE) if spec.has_token_scales else None
    write_kv_cache_triton(key.to(DEVICE), value.to(DEVICE), cache, slots.to(DEVICE), scales)
    assert torch.equal(cache.cpu().view(torch.uint8), ref_cache.view(torch.uint8))
    if scales is not None:
        assert torch.equal(scales.cpu(), ref_scales)
    with pytest.raises(ValueError, match="kv_scales"):
        write_kv_cache_triton(key.to(DEVICE), value.to(DEVICE), cache, slots.to(DEVICE),
                              None if scales is not None else torch.ones(shape[:4], device=DEVICE))


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_kv_unified_and_split(name):
    """The backend over a mixed batch (unified kernel: decodes, prefills, chunks reading cached
    context) and split-KV decodes, each KV dtype, against the float32 reference within the
    rounding bound."""
    query, key, value, cache, scales, meta, stored, floats, bound, scale = build_quantized(MIXED, name, seed=10)
    out = TritonPagedAttention().make_impl(scale).forward(query, key, value, cache, meta, kv_scales=scales)
    check_quantized(out, stored, floats, bound, torch.float32)
    query, key, value, cache, scales, meta, stored, floats, bound, scale = build_quantized(
        DECODES, name, num_kv_heads=1, group=8, block_size=4, seed=11)
    write_kv_cache_triton(key, value, cache, meta.slot_mapping, scales)
    out = torch.full_like(query, float("nan"))
    split_kv_decode(query, cache[0], cache[1], out, meta.block_tables, meta.seq_lens, meta.query_start_loc, 4,
                    scale, kv_scales=scales)
    check_quantized(out, stored, floats, bound, torch.float32)


def test_quantized_kv_bfloat16_queries_and_missing_scales():
    query, key, value, cache, scales, meta, stored, floats, bound, scale = build_quantized(
        MIXED, "int8", dtype=torch.bfloat16, head_dim=128, block_size=32, seed=12)
    out = TritonPagedAttention().make_impl(scale).forward(query, key, value, cache, meta, kv_scales=scales)
    check_quantized(out, stored, floats, bound, torch.bfloat16)
    with pytest.raises(ValueError, match="kv_scales"):
        TritonPagedAttention().make_impl(scale).forward(query, key, value, cache, meta)


# -- the backend --------------------------------------------------------------------------------

def test_backend_mixed_batch_and_split_kv_choice():
    backend = TritonPagedAttention(split_kv_min_seq_len=64)
    query, key, value, cache, meta, expected, scale = build(MIXED, seed=7)
    assert backend.num_splits(meta, cache) == 1  # prefills in the batch: unified kernel
    check(backend.make_impl(scale).forward(query, key, value, cache, meta), expected, torch.float32)
    query, key, value, cache, meta, expected, scale = build(DECODES, seed=8)
    assert backend.num_splits(meta, cache) > 1  # small decode-only batch, long context: split-KV
    out = backend.make_impl(scale, sliding_window=None, logit_soft_cap=None).forward(query, key, value, cache, meta)
    check(out, expected, torch.float32)
    assert TritonPagedAttention(split_kv_min_seq_len=10_000).num_splits(meta, cache) == 1


# -- the sweep the issue asks for (slow: every combination) -------------------------------------

SWEEP = list(itertools.product([16, 32], [1, 3, 8], [64, 128, 256]))


@pytest.mark.slow
@pytest.mark.parametrize("block_size,group,head_dim", SWEEP)
def test_sweep_block_size_group_head_dim(block_size, group, head_dim):
    """Unified (mixed batch) and split-KV (decodes), float32 and bfloat16, every layout."""
    for i, dtype in enumerate((torch.float32, torch.bfloat16)):
        window, softcap = ((None, None), (16, 20.0))[i]
        case = build(MIXED[2:], num_kv_heads=1, group=group, head_dim=head_dim, block_size=block_size,
                     dtype=dtype, window=window, softcap=softcap, seed=block_size + group + head_dim)
        check(run_unified(case, window, softcap), case[5], dtype)
        case = build(DECODES[1:], num_kv_heads=1, group=group, head_dim=head_dim, block_size=block_size,
                     dtype=dtype, window=window, softcap=softcap, seed=head_dim)
        check(run_split(case, 4, window, softcap), case[5], dtype)


# -- a model on the Triton backend ---------------------------------------------------------------

@pytest.mark.slow
def test_llama_on_triton_backend_matches_transformers():
    """Chunked prefill, prefill and decode steps mixed in one batch, through the whole model."""
    from pagedllm.models.llama import LlamaForCausalLM
    from tests.model_utils import make_hf_llama, run_paged, tiny_llama_config

    config = tiny_llama_config()
    hf = make_hf_llama(config, seed=3)
    model = LlamaForCausalLM(config, torch.float32, DEVICE, attn_backend=TritonPagedAttention())
    model.load_weights(hf.state_dict().items())
    seqs = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 27)]
    out = run_paged(model, seqs, [5, 20], block_size=16, chunk_size=8)
    for seq, logits in zip(seqs, out):
        with torch.no_grad():
            expected = hf(torch.tensor([seq])).logits[0]
        # On a GPU the model runs there (TF32-free float32 matmuls may still differ in summation order).
        assert (logits.cpu() - expected).abs().max().item() < (1e-4 if DEVICE == "cpu" else 1e-3)
