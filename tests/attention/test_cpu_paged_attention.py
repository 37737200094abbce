"""The fused CPU decode and prefill kernels (``pagedllm/native/cpu_paged.c``) against plain attention.

Each case puts every request's context K/V into a paged cache with shuffled block tables
(all other slots hold large garbage, so a read through a wrong slot shows), runs one step
through :class:`CpuPagedAttention`, and compares with float64 causal attention over the
contiguous K/V and with :class:`TorchPagedAttention` on the same inputs.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm import native
from pagedllm.attention import CpuPagedAttention, TorchPagedAttention, get_attention_backend
from pagedllm.attention import cpu_paged, torch_paged
from pagedllm.attention.backend import set_forward_context, write_kv_cache
from tests.model_utils import allocate_block_tables, make_metadata
from tests.reference import causal_attention

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
# (num_heads, num_kv_heads, head_dim): GQA (SmolLM2's 9/3 at head_dim 64), MQA, MHA, the generic
# head_dim path (32, 48) and the other unrolled one (128).
HEADS = {"gqa": (9, 3, 64), "mqa": (8, 1, 32), "mha": (4, 4, 48), "gqa128": (4, 2, 128)}


@pytest.fixture(scope="module")
def kernel():
    """The kernel, with prefill run for every layer (the tests check its numerics; on CPUs where
    torch's flash kernel is faster the engine keeps plain causal layers on torch:
    test_prefill_preferred_follows_the_cpu)."""
    k = cpu_paged.load_kernel()
    if k is None:
        pytest.skip("no C compiler: the kernel cannot be built here")
    k = cpu_paged.CpuPagedKernel(k.path)  # not the engine's shared instance
    k.prefill_all_layers = True
    return k


def build_case(reqs, block_size, dtype, heads, seed=0, window=None, soft_cap=None):
    """Random Q/K/V for requests [(context_len, query_len)] (decodes first), a cache holding each
    request's context, the step's metadata and the float64 reference output (with ``window`` /
    ``soft_cap`` as :func:`causal_attention`)."""
    num_heads, num_kv_heads, head_dim = heads
    scale = head_dim**-0.5
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    tables, num_blocks = allocate_block_tables(seq_lens, block_size, seed)
    cache = (100 * torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)).to(dtype)
    full_k = [torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype) for s in seq_lens]
    full_v = [torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype) for s in seq_lens]
    queries = [(2 * torch.randn(q, num_heads, head_dim, generator=g)).to(dtype) for _, q in reqs]
    for (c, _), table, k, v in zip(reqs, tables, full_k, full_v):
        for p in range(c):
            cache[:, table[p // block_size], p % block_size] = torch.stack([k[p], v[p]])
    meta = make_metadata([c for c, _ in reqs], [q for _, q in reqs], tables, block_size)
    query = torch.cat(queries)
    key = torch.cat([k[c:] for (c, _), k in zip(reqs, full_k)])
    value = torch.cat([v[c:] for (c, _), v in zip(reqs, full_v)])
    expected = torch.cat([causal_attention(q, k, v, c, scale, window, soft_cap)
                          for (c, _), q, k, v in zip(reqs, queries, full_k, full_v)])
    return query, key, value, cache, meta, expected, scale


def decode_reqs(block_size):
    """Decode contexts ending exactly at, just past and just before block (and tile) boundaries."""
    lens = [1, 2, block_size, block_size + 1, 2 * block_size, 3 * block_size - 1, 31, 32, 33, 64, 65, 200]
    return [(n - 1, 1) for n in sorted(set(lens))]


def run_both(query, key, value, cache, meta, scale, backend):
    """(kernel output, torch output) on separate copies of the cache, inside a forward context."""
    torch_cache = cache.clone()
    with set_forward_context(meta):
        out = backend.make_impl(scale).forward(query, key, value, cache, meta)
        ref = TorchPagedAttention().make_impl(scale).forward(query, key, value, torch_cache, meta)
    torch.testing.assert_close(cache, torch_cache, atol=0, rtol=0)  # the same K/V written
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_matches_causal_attention(kernel, block_size, heads, dtype):
    query, key, value, cache, meta, expected, scale = build_case(decode_reqs(block_size), block_size, dtype,
                                                                 HEADS[heads])
    assert meta.num_decodes == meta.num_reqs
    out, ref = run_both(query, key, value, cache, meta, scale, CpuPagedAttention(kernel=kernel))
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)
    torch.testing.assert_close(out.double(), ref.double(), atol=TOLERANCE[dtype], rtol=0)


MIXED = [(0, 1), (5, 1), (37, 1), (130, 1), (16, 1), (0, 13), (0, 1), (20, 7), (48, 16), (3, 40), (0, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_decode_and_prefill_batch(kernel, block_size, dtype):
    query, key, value, cache, meta, expected, scale = build_case(MIXED, block_size, dtype, HEADS["gqa"], seed=1)
    assert meta.num_decodes == 5
    out, ref = run_both(query, key, value, cache, meta, scale, CpuPagedAttention(kernel=kernel))
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)
    torch.testing.assert_close(out.double(), ref.double(), atol=TOLERANCE[dtype], rtol=0)


# (cached context, new tokens): fresh prompts, chunks over a long cached prefix, lengths just off
# the kernel's 64-key tiles and its query tiles (64 queries for 3-way GQA, 96 for 2-way).
PREFILLS = [(0, 2), (0, 100), (300, 64), (17, 33), (64, 64), (1000, 97), (129, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", ["gqa", "mha64", "gqa128", "mqa"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_over_cached_prefix_matches_causal_attention(kernel, block_size, heads, dtype, monkeypatch):
    """Chunked prefill / prefix hits: every chunk query sees the whole cached prefix and the chunk
    causally, read in place through shuffled blocks; the kernel runs (the torch path would fail)."""
    shapes = {**HEADS, "mha64": (4, 4, 64), "mqa": (8, 1, 64)}
    query, key, value, cache, meta, expected, scale = build_case([(40, 1), *PREFILLS], block_size, dtype,
                                                                 shapes[heads], seed=7)
    backend = CpuPagedAttention(kernel=kernel, min_tokens_per_thread=64)
    with set_forward_context(meta):
        ref = TorchPagedAttention().make_impl(scale).forward(query, key, value, cache.clone(), meta)
        monkeypatch.setattr(torch_paged, "_prefill_one", None)  # any fallback to the torch code fails
        out = backend.make_impl(scale).forward(query, key, value, cache, meta)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)
    torch.testing.assert_close(out.double(), ref.double(), atol=TOLERANCE[dtype], rtol=0)


@pytest.fixture(scope="module")
def pool_kernel(kernel):
    """The kernel built without OpenMP: the backend splits the work over its Python thread pool."""
    k = cpu_paged.CpuPagedKernel(cpu_paged._build(os.environ.get("CC", "cc"), openmp=False))
    assert not k.has_openmp
    k.prefill_all_layers = True
    return k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_thread_split_is_bitwise_deterministic(kernel, pool_kernel, dtype):
    """1, 2 or 3 threads, on the OpenMP team or the Python pool: the same bits."""
    query, key, value, cache, meta, expected, scale = build_case([(500, 200), (0, 70)], 16, dtype,
                                                                 HEADS["gqa"], seed=8)
    outs = [CpuPagedAttention(num_threads=n, kernel=k, min_tokens_per_thread=1).make_impl(scale).forward(
        query, key, value, cache.clone(), meta) for k in (kernel, pool_kernel) for n in (1, 2, 3)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=0, rtol=0)
    torch.testing.assert_close(outs[0].double(), expected, atol=TOLERANCE[dtype], rtol=0)
    costs = kernel.prefill_work_items(200, 500, 9, 3)  # 64-query tiles (x 3 heads = 192 rows) x 3 KV heads
    assert len(costs) == 4 * 3 and costs[:3] == [64 * 564] * 3 and costs[-1] == 8 * 700  # (query, key) pairs


def test_prefill_threads_follow_query_key_pairs(kernel, monkeypatch):
    """A prompt's work is (query, key) pairs, not keys: a 256-token prompt (~33k pairs per KV head,
    ~1 ms of one thread) is split over the team under the default threshold, a 16-token one
    (~400 pairs) runs on the calling thread."""
    if not kernel.has_openmp:
        pytest.skip("torch runs without libgomp here: the kernel has no OpenMP team")
    query, key, value, cache, meta, expected, scale = build_case([(0, 256), (0, 16)], 16, torch.float32,
                                                                 HEADS["gqa"], seed=3)
    seen = []
    real = kernel.prefill
    monkeypatch.setattr(kernel, "prefill", lambda *a: seen.append(a[8]) or real(*a))
    with set_forward_context(meta):
        out = CpuPagedAttention(num_threads=2, kernel=kernel).make_impl(scale).forward(query, key, value, cache, meta)
    assert seen == [2, 1]
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.float32], rtol=0)


# (cached context, new tokens) x window: chunks whose first queries see the whole prefix and whose
# last ones do not (the window edge inside the chunk), windows shorter than the chunk, around the
# kernel's 64-key tiles, W = 1, and a long cached prefix of which only the last W tokens count.
WINDOW_PREFILLS = [(0, 100), (300, 64), (17, 33), (1000, 97), (129, 5), (60, 130)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", ["gqa", "gemma3"])
@pytest.mark.parametrize("window, soft_cap", [(1, None), (63, None), (64, 50.0), (65, None), (330, None),
                                              (None, 5.0), (100, 3.0)])
def test_prefill_window_and_soft_cap_match_reference(kernel, window, soft_cap, heads, dtype, monkeypatch):
    """Sliding-window and soft-capped prefills run in the kernel (the torch code would fail) and
    equal float64 attention; keys before the first query's window are NaN in the cache, so a
    kernel reading them (even masked: 0 * NaN) fails."""
    shapes = {"gqa": HEADS["gqa"], "gemma3": (4, 1, 256)}  # Gemma 3 270M's 4 heads / 1 KV head of 256
    reqs = [(40, 1), *WINDOW_PREFILLS]
    query, key, value, cache, meta, expected, scale = build_case(reqs, 16, dtype, shapes[heads], seed=9,
                                                                 window=window, soft_cap=soft_cap)
    if window is not None:
        for b, (c, _) in enumerate(reqs):
            for p in range(max(0, c - window + 1)):
                cache[:, meta.block_tables[b, p // 16], p % 16] = float("nan")
    monkeypatch.setattr(torch_paged, "_prefill_one_masked", None)
    with set_forward_context(meta):
        impl = CpuPagedAttention(kernel=kernel, min_tokens_per_thread=64).make_impl(scale, window, soft_cap)
        out = impl.forward(query, key, value, cache, meta)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("window, soft_cap", [(50, None), (None, 30.0), (70, 5.0)])
def test_prefill_window_thread_split_is_bitwise_deterministic(kernel, pool_kernel, window, soft_cap):
    """With a window or a soft cap too: 1, 2 or 3 threads, OpenMP team or Python pool, the same bits;
    the work items' costs count only the keys in each tile's window."""
    query, key, value, cache, meta, expected, scale = build_case([(500, 200), (0, 70)], 16, torch.float32,
                                                                 HEADS["gqa"], seed=8, window=window,
                                                                 soft_cap=soft_cap)
    outs = [CpuPagedAttention(num_threads=n, kernel=k, min_tokens_per_thread=1).make_impl(scale, window, soft_cap)
            .forward(query, key, value, cache.clone(), meta)
        for k in (kernel, pool_kernel) for n in (1, 2, 3)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=0, rtol=0)
    torch.testing.assert_close(outs[0].double(), expected, atol=TOLERANCE[torch.float32], rtol=0)
    costs = kernel.prefill_work_items(200, 500, 9, 3, sliding_window=50)
    assert costs[:3] == [64 * (64 + 49)] * 3 and costs[-1] == 8 * (8 + 49)  # tiles at 500.., 692..; 49 earlier keys each


def test_prefill_preferred_follows_the_cpu(monkeypatch):
    """AVX-512 builds prefill every layer in the kernel; other builds only soft-capped layers, the
    rest go to the torch code (the torch path is then called, the kernel's prefill is not)."""
    k = cpu_paged.load_kernel()
    if k is None:
        pytest.skip("no C compiler: the kernel cannot be built here")
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert k.prefill_all_layers == avx512
    assert k.prefill_preferred(None) == avx512 and k.prefill_preferred(50.0)
    query, key, value, cache, meta, expected, scale = build_case([(40, 1), (100, 30)], 16, torch.float32,
                                                                 HEADS["gqa"], seed=3)
    calls = []
    real = k.prefill
    monkeypatch.setattr(k, "prefill", lambda *a: calls.append(1) or real(*a))
    with set_forward_context(meta):
        out = CpuPagedAttention(kernel=k).make_impl(scale).forward(query, key, value, cache, meta)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.float32], rtol=0)
    assert bool(calls) == avx512


def test_prefill_falls_back_for_head_dim(kernel):
    """head_dim not a multiple of 64 prefills with the torch code (window and soft cap too)."""
    assert not kernel.supports_prefill(torch.float32, 4, 48) and kernel.supports_prefill(torch.bfloat16, 4, 128)
    query, key, value, cache, meta, expected, scale = build_case(PREFILLS[:4], 16, torch.float32, HEADS["mha"],
                                                                 seed=9, window=20, soft_cap=30.0)
    out = CpuPagedAttention(kernel=kernel).make_impl(scale, 20, 30.0).forward(query, key, value, cache.clone(), meta)
    ref = TorchPagedAttention().make_impl(scale, 20, 30.0).forward(query, key, value, cache.clone(), meta)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thread_split_is_bitwise_deterministic(kernel, pool_kernel, dtype):
    """Decodes over 1, 2, 3 or 5 threads, on the OpenMP team or the Python pool: the same bits."""
    query, key, value, cache, meta, expected, scale = build_case(decode_reqs(16), 16, dtype, HEADS["gqa"], seed=2)
    outs = []
    for k in (kernel, pool_kernel):
        for num_threads in (1, 2, 3, 5):
            with set_forward_context(meta):
                backend = CpuPagedAttention(num_threads=num_threads, kernel=k, min_tokens_per_thread=1)
                outs.append(backend.make_impl(scale).forward(query, key, value, cache.clone(), meta))
                plan, = backend._kernel_plans
                assert plan.num_threads == num_threads
                assert len(plan.ranges) == (0 if k.has_openmp else min(num_threads, meta.num_reqs))
    assert CpuPagedAttention(num_threads=4, kernel=kernel).kernel_plan(meta, cache).num_threads == 1  # too small
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=0, rtol=0)
    torch.testing.assert_close(outs[0].double(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("new_dtype, cache_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                     (torch.float32, torch.float32)])
def test_kv_write_in_kernel_equals_torch_write(kernel, new_dtype, cache_dtype):
    """The kernel's K/V write (decode call or write-only call before a prefill) stores the bits
    write_kv_cache stores: float32 rounded to bfloat16 to nearest even (ties and inf included; a NaN
    stays a NaN, whose payload torch's own conversion does not fix), bfloat16 widened exactly; K/V
    given as views of a fused projection output (row stride > row)."""
    reqs = [(5, 1), (40, 1), (0, 6)]
    query, key, value, cache, meta, _, scale = build_case(reqs, 16, new_dtype, HEADS["gqa"], seed=12)
    fused = torch.cat([key, value], dim=1)  # (T, 2 * num_kv_heads, head_dim): key, value are strided views
    fused.view(-1)[:4] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, float("nan"), float("inf")])  # ties, nan, inf
    key, value = fused[:, :3], fused[:, 3:]
    cache = cache.to(cache_dtype)
    prefill_only = make_metadata([0], [6], [meta.block_tables[2].tolist()], 16)  # the write-only kernel call
    for m in (meta, prefill_only):
        n = m.query_start_loc_cpu[-1]
        k, v, q = key[-n:], value[-n:], query[-n:]
        expected, got = cache.clone(), cache.clone()
        write_kv_cache(k, v, expected, m.slot_mapping)
        with set_forward_context(m):
            CpuPagedAttention(kernel=kernel).make_impl(scale).forward(q, k, v, got, m)
        nan = expected.isnan()
        assert torch.equal(got.isnan(), nan) and bool(nan.any()) == (m is meta)  # row 0 is written in the decode step
        bits = torch.int16 if cache_dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(bits)[~nan], expected.view(bits)[~nan])


def test_bfloat16_queries_and_outputs_read_and_written_in_place(kernel, monkeypatch):
    """bf16 queries go to the kernel as they are and its bf16 output equals the float32 one rounded
    by torch (round to nearest even): the same bits as converting around a float32 call."""
    reqs = decode_reqs(16) + [(60, 70), (0, 9)]
    query, key, value, cache, meta, expected, scale = build_case(reqs, 16, torch.bfloat16, HEADS["gqa"], seed=11)
    backend = CpuPagedAttention(kernel=kernel, min_tokens_per_thread=1)
    with set_forward_context(meta):
        out = backend.make_impl(scale).forward(query, key, value, cache.clone(), meta)
    with monkeypatch.context() as m, set_forward_context(meta):
        m.setattr(cpu_paged, "_io_tensors", lambda q, o: (q.float().contiguous(), torch.empty(q.shape)))
        via_float = backend.make_impl(scale).forward(query, key, value, cache.clone(), meta)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, via_float, atol=0, rtol=0)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.bfloat16], rtol=0)
    q, result = cpu_paged._io_tensors(query, torch.empty_like(query))
    assert q is query and result.dtype == torch.bfloat16


@pytest.mark.skipif(not native.openmp_available(), reason="torch does not run on libgomp here")
def test_kernel_runs_on_torch_openmp_team(kernel):
    """Built with OpenMP on torch's libgomp: a team of n threads, no thread of its own started."""
    assert kernel.has_openmp
    n = torch.get_num_threads()
    torch.ones(1 << 20).exp_().sum()  # torch's team exists now
    threads = len(os.listdir("/proc/self/task"))
    assert kernel._lib.pagedllm_cpu_paged_team_size(n) == n
    assert len(os.listdir("/proc/self/task")) == threads


def test_plan_shared_by_layers_and_renewed_per_step(kernel):
    """Two layers in one forward context share the plan; the next step's context gets its own."""
    backend = CpuPagedAttention(kernel=kernel)
    step1 = build_case([(10, 1), (40, 1)], 16, torch.float32, HEADS["gqa"], seed=3)
    step2 = build_case([(70, 1), (3, 1), (16, 1)], 16, torch.float32, HEADS["gqa"], seed=4)
    for query, key, value, cache, meta, expected, scale in (step1, step2):
        with set_forward_context(meta):
            layer0 = backend.make_impl(scale).forward(query, key, value, cache.clone(), meta)
            plan, = backend._kernel_plans
            layer1 = backend.make_impl(scale).forward(query, key, value, cache.clone(), meta)
            assert len(backend._kernel_plans) == 1 and backend._kernel_plans[0] is plan
        for out in (layer0, layer1):
            torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)


def test_non_contiguous_query_and_unsupported_head_dim(kernel):
    query, key, value, cache, meta, expected, scale = build_case(MIXED, 16, torch.float32, HEADS["gqa"], seed=5)
    wide = torch.cat([query, torch.full_like(query, 1e4)], dim=-1)[..., :query.shape[-1]]  # strided view
    assert not wide.is_contiguous()
    out, _ = run_both(wide, key, value, cache, meta, scale, CpuPagedAttention(kernel=kernel))
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)
    assert not kernel.supports(torch.float32, 4, 24) and not kernel.supports(torch.float16, 4, 64)
    query, key, value, cache, meta, expected, scale = build_case(MIXED, 16, torch.float32, (4, 2, 24), seed=6)
    out, _ = run_both(query, key, value, cache, meta, scale, CpuPagedAttention(kernel=kernel))  # torch path
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)


def test_block_id_outside_cache_raises(kernel):
    query, key, value, cache, meta, _, scale = build_case([(20, 1), (5, 1)], 16, torch.float32, HEADS["gqa"])
    meta.block_tables[1, 0] = cache.shape[1]  # one past the last block
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\]"):
        CpuPagedAttention(kernel=kernel).make_impl(scale).forward(query, key, value, cache, meta)
    query, key, value, cache, meta, _, scale = build_case([(20, 1), (40, 9)], 16, torch.float32, HEADS["gqa"])
    meta.block_tables[1, 2] = -1
    with pytest.raises(ValueError, match=r"block_tables\[1, 2\] = -1"):
        CpuPagedAttention(kernel=kernel).make_impl(scale).forward(query, key, value, cache, meta)


@pytest.mark.parametrize("lens, parts, expected", [
    ([10, 10, 10, 10], 2, [(0, 2), (2, 4)]),
    ([100, 1, 1, 1], 2, [(0, 1), (1, 4)]),
    ([1, 1, 1, 100], 2, [(0, 3), (3, 4)]),
    ([5, 5, 5], 8, [(0, 1), (1, 2), (2, 3)]),
    ([7], 4, [(0, 1)]),
    ([3, 3, 3, 3, 3, 3], 3, [(0, 2), (2, 4), (4, 6)]),
])
def test_balanced_ranges(lens, parts, expected):
    assert cpu_paged._balanced_ranges(lens, parts) == expected


def test_build_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    path = cpu_paged._build(os.environ.get("CC", "cc"))
    assert path.parent == tmp_path and path.name.startswith("cpu_paged_") and path.suffix == ".so"
    mtime = path.stat().st_mtime_ns
    assert cpu_paged._build(os.environ.get("CC", "cc")) == path and path.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left
    assert cpu_paged.CpuPagedKernel(path).supports(torch.bfloat16, 9, 64)


@pytest.mark.parametrize("compiler", ["pagedllm-no-such-compiler", "false"])
def test_fallback_when_build_fails(tmp_path, monkeypatch, caplog, compiler):
    """A missing or failing compiler logs one warning and gives the torch backend's results."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", compiler)
    monkeypatch.delenv("PAGEDLLM_ATTENTION_BACKEND", raising=False)
    monkeypatch.setattr(cpu_paged, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger="pagedllm.attention.cpu_paged"):
        backend = CpuPagedAttention()
        assert cpu_paged.load_kernel() is None
    assert not backend.is_kernel_available
    assert len([r for r in caplog.records if "kernel unavailable" in r.getMessage()]) == 1
    assert isinstance(get_attention_backend("cpu"), TorchPagedAttention)
    query, key, value, cache, meta, expected, scale = build_case(MIXED, 16, torch.float32, HEADS["gqa"])
    out = backend.make_impl(scale).forward(query, key, value, cache, meta)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)


def test_backend_selection(kernel):
    assert isinstance(get_attention_backend("cpu"), CpuPagedAttention)
    assert type(get_attention_backend("cpu", "torch")) is TorchPagedAttention
    assert isinstance(get_attention_backend("cpu", "cpu"), CpuPagedAttention)
    with pytest.raises(ValueError, match="needs a CPU device"):
        get_attention_backend("cuda", "cpu")
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("cpu", "bogus")


def test_arguments_validated():
    with pytest.raises(ValueError, match="num_threads"):
        CpuPagedAttention(num_threads=0)
    with pytest.raises(ValueError, match="min_tokens_per_thread"):
        CpuPagedAttention(min_tokens_per_thread=0)


def test_benchmark_quick_runs(kernel):
    """benchmarks/attention_kernel.py --quick runs both backends and checks they agree."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_kernel.py"
    res = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("attention_kernel B=4 ctx~40 block 16") and "bfloat16: torch" in res.stdout


@pytest.mark.parametrize("chunk_size", [None, 64])
def test_model_chunked_prefill_with_long_prefix_matches_transformers(kernel, chunk_size):
    """A Llama with SmolLM2's head layout (3-way GQA, head_dim 64) on the C kernels: a 300-token
    prompt in one step or in 64-token chunks over its growing cached prefix, then decodes; logits
    equal transformers' on the same weights."""
    from pagedllm.models.llama import LlamaForCausalLM
    from tests.model_utils import make_hf_llama, run_paged, tiny_llama_config
    config = tiny_llama_config(hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                               max_position_embeddings=512)
    hf = make_hf_llama(config, seed=3)
    model = LlamaForCausalLM(config, torch.float32, torch.device("cpu"), attn_backend=CpuPagedAttention(kernel=kernel))
    model.load_weights(hf.state_dict().items())
    seqs = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (306, 90)]
    out = run_paged(model.eval(), seqs, [300, 90], block_size=16, chunk_size=chunk_size)
    with torch.no_grad():
        for seq, logits in zip(seqs, out):
            diff = (logits - hf(torch.tensor([seq])).logits[0]).abs().max().item()
            assert diff < 1e-4, f"max abs diff {diff} (len {len(seq)})"


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_sliding_window_and_soft_cap_prefill_matches_transformers(kernel, family, monkeypatch):
    """Tiny Gemma 2 (window + attention soft cap) and Gemma 3 (local / global layers) with head_dim 64
    on the C kernels: 150-token prompts prefilled in 40-token chunks over a 48-token window (chunks
    whose first queries see their whole cached prefix and whose last do not), then decodes; the
    torch masked-prefill code is disabled, logits equal transformers' (eager) on the same weights."""
    from pagedllm.models import get_model_class
    from tests.family_utils import family_config, make_hf_model
    from tests.model_utils import run_paged
    config = family_config(family, head_dim=64, query_pre_attn_scalar=64, sliding_window=48)
    hf = make_hf_model(config, seed=4)
    model = get_model_class(config)(config, torch.float32, "cpu", attn_backend=CpuPagedAttention(kernel=kernel))
    model.load_weights(hf.state_dict().items())
    monkeypatch.setattr(torch_paged, "_prefill_one_masked", None)
    seqs = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (156, 61)]
    out = run_paged(model.eval(), seqs, [150, 61], block_size=16, chunk_size=40)
    with torch.no_grad():
        for seq, logits in zip(seqs, out):
            diff = (logits - hf(torch.tensor([seq])).logits[0]).abs().max().item()
            assert diff < 1e-4, f"max abs diff {diff} (len {len(seq)})"


@pytest.mark.parametrize("flags", [(), ("-DPAGEDLLM_NO_AVX512BF16",), ("-march=haswell",)],
                         ids=["native", "exact-rounding", "avx2"])
def test_bfloat16_outputs_with_subnormals_and_nan_are_torch_rounding(kernel, flags, monkeypatch):
    """Every build (AVX512-BF16's conversion, the exact integer one, an AVX2 host's) rounds the bf16
    output as torch does, also where it is subnormal (a tiny V) or NaN (a NaN query)."""
    reqs = decode_reqs(16)
    query, key, value, cache, meta, _, scale = build_case(reqs, 16, torch.bfloat16, HEADS["gqa"], seed=13)
    cache[1] *= 1e-38  # V: outputs ~1e-38, bfloat16 subnormals among them
    value *= 1e-38
    query[3, 2, 5] = float("nan")  # request 3, query head 2: a NaN output row
    built = cpu_paged.CpuPagedKernel(cpu_paged._build(os.environ.get("CC", "cc"), flags))
    backend = CpuPagedAttention(kernel=built, min_tokens_per_thread=1)
    with set_forward_context(meta):
        out = backend.make_impl(scale).forward(query, key, value, cache.clone(), meta)
    with monkeypatch.context() as m, set_forward_context(meta):
        m.setattr(cpu_paged, "_io_tensors", lambda q, o: (q.float().contiguous(), torch.empty(q.shape)))
        via_float = backend.make_impl(scale).forward(query, key, value, cache.clone(), meta).bfloat16()
    nan = via_float.isnan()
    assert nan[3, 2].all() and nan.sum() == 64 and torch.equal(out.isnan(), nan)
    assert (via_float.float().abs() < 2.0 ** -126).logical_and(via_float != 0).sum() > 100  # subnormals
    assert torch.equal(out.view(torch.int16)[~nan], via_float.view(torch.int16)[~nan])
