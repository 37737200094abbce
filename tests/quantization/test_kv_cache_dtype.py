"""KV-cache dtypes: names, storage bytes, and the quantize/dequantize round trip bounded by
each format's rounding error."""

from __future__ import annotations

import importlib.util
import os
import platform

import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.quantization.kv_cache import as_bytes, dequantize_kv, quantize_kv, resolve_kv_cache_dtype


def test_names_resolve_to_storage():
    assert resolve_kv_cache_dtype("auto", torch.float32).storage == torch.float32
    assert resolve_kv_cache_dtype("bfloat16", torch.float32).storage == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32).storage == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8", torch.float32).name == "fp8_e4m3"
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float32).storage == torch.float8_e5m2
    int8 = resolve_kv_cache_dtype("int8", torch.float32)
    assert int8.storage == torch.int8 and int8.has_token_scales
    # bytes per token and head: head_dim 64 -> 256 (f32), 128 (bf16), 64 (fp8), 64 + 4 (int8 + scale)
    assert [resolve_kv_cache_dtype(n, torch.float32).bytes_per_token_head(64)
            for n in ("auto", "bfloat16", "fp8", "int8")] == [256, 128, 64, 68]


def test_unknown_kv_cache_dtype_names_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("float8", torch.float32)


def test_fp8_without_float8_in_torch_names_the_field(monkeypatch):
    monkeypatch.delattr(torch, "float8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2' needs a torch build"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.float32)


@pytest.mark.parametrize("name, rel_step", [("bfloat16", 2**-7), ("fp8_e4m3", 2**-3), ("fp8_e5m2", 2**-2)])
def test_float_round_trip_within_half_an_ulp(name, rel_step):
    x = torch.randn(50, 3, 16) * 4
    spec = resolve_kv_cache_dtype(name, torch.float32)
    stored, scales = quantize_kv(x, spec.storage)
    assert stored.dtype == spec.storage and scales is None
    back = dequantize_kv(stored, None, torch.float32)
    # round to nearest: relative error at most half the spacing (normal range; |x| >= 2**-6 here)
    big = x.abs() > 2**-6
    assert ((back - x).abs()[big] <= rel_step / 2 * x.abs()[big] * (1 + 1e-6)).all()


def test_fp8_saturates_instead_of_overflowing():
    stored, _ = quantize_kv(torch.tensor([[[1000.0, -1e6]]]), torch.float8_e4m3fn)
    assert dequantize_kv(stored, None, torch.float32).tolist() == [[[448.0, -448.0]]]
    stored, _ = quantize_kv(torch.tensor([[[1e5, -float("inf")]]]), torch.float8_e5m2)
    assert dequantize_kv(stored, None, torch.float32).tolist() == [[[57344.0, -57344.0]]]


def test_int8_per_token_head_scales():
    x = torch.randn(50, 3, 16)
    x[7, 1] = 0.0  # an all-zero head must not divide by zero
    q, scales = quantize_kv(x, torch.int8)
    assert q.dtype == torch.int8 and scales.shape == (50, 3) and scales.dtype == torch.float32
    assert torch.allclose(scales, torch.where(x.abs().amax(-1) > 0, x.abs().amax(-1) / 127, torch.ones(())))
    back = dequantize_kv(q, scales, torch.float32)
    assert ((back - x).abs() <= scales.unsqueeze(-1) / 2 * (1 + 1e-5)).all()
    assert torch.equal(back[7, 1], torch.zeros(16))


# -- paged attention over each KV dtype -----------------------------------------------------

from pagedllm.attention import CpuPagedAttention, TorchPagedAttention  # noqa: E402
from pagedllm.attention import cpu_paged  # noqa: E402
from pagedllm.attention.torch_paged import TorchPagedAttentionImpl  # noqa: E402
from pagedllm.attention.backend import set_forward_context, write_kv_cache  # noqa: E402
from tests.model_utils import allocate_block_tables, kv_rounding_error_bound, make_metadata  # noqa: E402
from tests.attention.test_attention import HEAD_DIM, MIXED, NUM_HEADS, NUM_KV_HEADS, SCALE  # noqa: E402
from tests.reference import causal_attention  # noqa: E402

KV_NAMES = ["bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"]


def _backends():
    cpu = CpuPagedAttention()
    return [TorchPagedAttention()] + ([cpu] if cpu.is_kernel_available else [])


def _round_trip(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    stored, scales = quantize_kv(x, storage)
    return dequantize_kv(stored, scales, torch.float32)


def _case(name: str, block_size: int, seed: int = 0, reqs=MIXED, heads=(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)):
    """Random float32 Q/K/V for requests ``reqs`` [(context_len, query_len)]; the context written
    into a cache of the KV dtype through write_kv_cache (as earlier steps would have)."""
    num_heads, num_kv_heads, head_dim = heads
    spec = resolve_kv_cache_dtype(name, torch.float32)
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    tables, num_blocks = allocate_block_tables(seq_lens, block_size, seed)
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=spec.storage)
    scales = torch.ones(2, num_blocks, block_size, num_kv_heads) if spec.has_token_scales else None
    ks = [2 * torch.randn(s, num_kv_heads, head_dim, generator=g) for s in seq_lens]
    vs = [torch.randn(s, num_kv_heads, head_dim, generator=g) for s in seq_lens]
    for k in ks:  # values in float8's subnormal range too
        k[::7] *= 1e-3
    qs = [torch.randn(q, num_heads, head_dim, generator=g) for _, q in reqs]
    for (c, _), table, k, v in zip(reqs, tables, ks, vs):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(c)], dtype=torch.int64)
        write_kv_cache(k[:c], v[:c], cache, slots, scales)
    meta = make_metadata([c for c, _ in reqs], [q for _, q in reqs], tables, block_size)
    new_k = torch.cat([k[c:] for (c, _), k in zip(reqs, ks)])
    new_v = torch.cat([v[c:] for (c, _), v in zip(reqs, vs)])
    return spec, torch.cat(qs), new_k, new_v, cache, scales, meta, (qs, ks, vs)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("name", KV_NAMES)
def test_paged_attention_reads_and_writes_each_kv_dtype(name, block_size):
    for backend in _backends():
        spec, query, key, value, cache, scales, meta, (qs, ks, vs) = _case(name, block_size)
        kwargs = {"kv_scales": scales} if scales is not None else {}
        out = backend.make_impl(SCALE).forward(query, key, value, cache, meta, **kwargs).double()
        start = 0
        for (c, n), q, k, v in zip(MIXED, qs, ks, vs):
            k2, v2 = _round_trip(k, spec.storage), _round_trip(v, spec.storage)
            got = out[start:start + n]
            # exactly the attention over the stored (rounded) K/V ...
            torch.testing.assert_close(got, causal_attention(q, k2, v2, c, SCALE), atol=2e-5, rtol=0)
            # ... hence within the rounding's bound of the float32 attention
            err = (got - causal_attention(q, k, v, c, SCALE)).abs().amax(-1)  # (Q, H)
            assert (err <= kv_rounding_error_bound(q, k[:c + n], v[:c + n], k2[:c + n], v2[:c + n], SCALE) + 2e-5).all()
            start += n
        # this step's K/V landed at their slots, rounded
        slot_k = as_bytes(cache[0]).view(-1, NUM_KV_HEADS, HEAD_DIM)[meta.slot_mapping].view(spec.storage)
        slot_s = None if scales is None else scales[0].view(-1, NUM_KV_HEADS)[meta.slot_mapping]
        torch.testing.assert_close(dequantize_kv(slot_k, slot_s, torch.float32), _round_trip(key, spec.storage))


def _decode_reqs(block_size: int) -> list[tuple[int, int]]:
    """Decode contexts ending at, just past and just before block and kernel-tile (32) boundaries."""
    lens = {1, 2, block_size, block_size + 1, 3 * block_size - 1, 31, 32, 33, 65, 200}
    return [(n - 1, 1) for n in sorted(lens)]


def _kernel_only(backend: CpuPagedAttention, monkeypatch) -> None:
    """Make a fallback to the torch decode an error, so the C kernel is what is tested."""
    assert backend.is_kernel_available

    def no_fallback(*args, **kwargs):
        raise AssertionError("decode fell back to the torch code")
    monkeypatch.setattr(TorchPagedAttentionImpl, "_decode", no_fallback)


def _check_decode_kernel(backend: CpuPagedAttention, name: str, block_size: int, heads, seed: int = 0) -> torch.Tensor:
    """The kernel's decodes over a cache of ``name`` against the attention over the stored
    (dequantized) K/V (2e-5) and the float32 attention (the rounding's bound). Returns its output."""
    reqs = _decode_reqs(block_size)
    scale = heads[2] ** -0.5
    spec, query, key, value, cache, scales, meta, (qs, ks, vs) = _case(name, block_size, seed, reqs, heads)
    kwargs = {"kv_scales": scales} if scales is not None else {}
    with set_forward_context(meta):
        out = backend.make_impl(scale).forward(query, key, value, cache, meta, **kwargs).double()
    for b, ((c, _), q, k, v) in enumerate(zip(reqs, qs, ks, vs)):
        k2, v2 = _round_trip(k, spec.storage), _round_trip(v, spec.storage)
        torch.testing.assert_close(out[b:b + 1], causal_attention(q, k2, v2, c, scale), atol=2e-5, rtol=0)
        err = (out[b:b + 1] - causal_attention(q, k, v, c, scale)).abs().amax(-1)  # (1, H)
        assert (err <= kv_rounding_error_bound(q, k, v, k2, v2, scale) + 2e-5).all()
    return out


# (num_heads, num_kv_heads, head_dim): SmolLM2's GQA at 64 (an unrolled copy), MQA at 32 and MHA at 48
# (the generic head_dim loop), GQA at 128 (the other unrolled copy)
KERNEL_HEADS = [(9, 3, 64), (8, 1, 32), (4, 4, 48), (4, 2, 128)]


@pytest.mark.parametrize("heads", KERNEL_HEADS, ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("name", KV_NAMES)
def test_cpu_kernel_decodes_each_kv_dtype(name, block_size, heads, monkeypatch):
    """The C kernel reads bfloat16/fp8/int8 blocks itself (no torch fallback), block ids shuffled,
    contexts across block and tile boundaries, float8 subnormals included."""
    backend = CpuPagedAttention()
    if not backend.is_kernel_available:
        pytest.skip("no C compiler: the kernel cannot be built here")
    _kernel_only(backend, monkeypatch)
    _check_decode_kernel(backend, name, block_size, heads)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 ISA levels")
def test_cpu_kernel_built_for_avx2_only_gives_the_same_decodes(tmp_path, monkeypatch):
    """Built for x86-64-v3 (AVX2 + FMA, no AVX-512), as on an AVX2-only CPU, the quantized decodes
    still read correctly and match the native build."""
    native = CpuPagedAttention()
    if not native.is_kernel_available:
        pytest.skip("no C compiler: the kernel cannot be built here")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    avx2 = CpuPagedAttention(kernel=cpu_paged.CpuPagedKernel(cpu_paged._build(os.environ.get("CC", "cc"),
                                                                              ("-march=x86-64-v3",))))
    _kernel_only(avx2, monkeypatch)
    for name in ("fp8_e4m3", "fp8_e5m2", "int8"):
        out = _check_decode_kernel(avx2, name, 16, (9, 3, 64), seed=4)
        torch.testing.assert_close(out, _check_decode_kernel(native, name, 16, (9, 3, 64), seed=4), atol=1e-6, rtol=0)


def test_int8_cache_needs_its_scales():
    spec, query, key, value, cache, scales, meta, _ = _case("int8", 16)
    with pytest.raises(ValueError, match="kv_scales"):
        TorchPagedAttention().make_impl(SCALE).forward(query, key, value, cache, meta)


# -- the engine over a quantized KV cache -----------------------------------------------------

from pagedllm import LLM, SamplingParams  # noqa: E402
from tests.engine.test_engine_equivalence import _prompts, _tokens  # noqa: E402


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_engine_prefix_caching_chunking_preemption_unchanged(tiny_model_dir, name):
    """With a quantized KV cache every prefill reads K/V back from the cache, so greedy output
    is the same token for token alone, batched, with a prefix hit, chunked and preempted."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    system = _prompts(1, seed=7, lo=40, hi=40)[0]["prompt_token_ids"]
    prompts = _prompts(6, seed=3, lo=3, hi=60, prefix=system)

    def make(**kw):
        kw.setdefault("max_model_len", 256)
        return LLM(model=str(tiny_model_dir), kv_cache_dtype=name, **kw)

    alone = make(num_kv_blocks=256, enable_prefix_caching=False, enable_chunked_prefill=False,
                 max_num_batched_tokens=256)
    ref = [_tokens(alone.generate([p], greedy, use_tqdm=False))[0] for p in prompts]
    cached = make(num_kv_blocks=256, enable_prefix_caching=True)
    outs = cached.generate(prompts[:1], greedy, use_tqdm=False) + cached.generate(prompts[1:], greedy, use_tqdm=False)
    assert _tokens(outs) == ref and all(o.num_cached_tokens == 32 for o in outs[1:])
    chunked = make(num_kv_blocks=256, enable_prefix_caching=False, max_num_batched_tokens=16)
    assert _tokens(chunked.generate(prompts, greedy, use_tqdm=False)) == ref
    # swap preemption moves the fp8/int8 blocks (and int8's scales) out and back
    small = make(num_kv_blocks=10, max_model_len=128, enable_prefix_caching=False, preemption_mode="swap")
    outs = small.generate(prompts, greedy, use_tqdm=False)
    assert _tokens(outs) == ref
    assert {m for o in outs for m in o.metrics.preemption_modes} == {"swap"}


def test_capacity_report_states_dtype_and_tokens(tiny_model_dir):
    """Same byte budget: int8 (head_dim 16: 16 + 4 bytes per token and head) holds 64/20 as
    many tokens as float32 (64 bytes), fp8 4x, bfloat16 2x."""
    blocks = {}
    for name, label in [("auto", "float32"), ("bfloat16", "bfloat16"), ("fp8", "fp8"), ("int8", "int8")]:
        llm = LLM(model=str(tiny_model_dir), kv_cache_dtype=name, kv_cache_memory="4MiB", max_model_len=256)
        spec = llm.llm_engine.kv_cache_spec
        # 2 layers x 2 (K, V) x 16 tokens x 2 KV heads x bytes per token-head
        per_token_head = {"auto": 64, "bfloat16": 32, "fp8": 16, "int8": 20}[name]
        assert spec.bytes_per_block == 2 * 2 * 16 * 2 * per_token_head
        assert spec.num_blocks == 4 * 2**20 // spec.bytes_per_block
        assert spec.describe().startswith(f"KV cache ({label}): {spec.num_blocks} blocks x 16 tokens = "
                                          f"{spec.num_tokens} tokens")
        blocks[name] = spec.num_blocks
    assert blocks["bfloat16"] == 2 * blocks["auto"] and blocks["fp8"] == 4 * blocks["auto"]
    assert blocks["int8"] == 4 * 2**20 // (2 * 2 * 16 * 2 * 20)


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_engine_on_triton_backend_matches_torch_backend(tiny_model_dir, monkeypatch, name):
    """The Triton kernels (interpreted on CPU) write and read the quantized cache as the torch
    backend does: the same greedy tokens, prefix hit and chunked prefill included."""
    if importlib.util.find_spec("triton") is None or (not torch.cuda.is_available()
                                                       and os.environ.get("TRITON_INTERPRET") != "1"):
        pytest.skip("needs triton (interpreted on CPU)")
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    system = _prompts(1, seed=7, lo=20, hi=20)[0]["prompt_token_ids"]
    prompts = _prompts(3, seed=5, lo=3, hi=12, prefix=system)
    outs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", backend)
        llm = LLM(model=str(tiny_model_dir), kv_cache_dtype=name, num_kv_blocks=64, max_model_len=64,
                  max_num_batched_tokens=24, enforce_eager=True)
        outs[backend] = _tokens(llm.generate(prompts[:1], greedy, use_tqdm=False)
                                + llm.generate(prompts[1:], greedy, use_tqdm=False))
    assert outs["triton"] == outs["torch"]


def test_backend_without_quantized_kv_refuses_it(tiny_model_dir, monkeypatch):
    """A backend that cannot store fp8/int8 (FlashInfer) is refused up front, naming the field."""
    from pagedllm.worker import model_runner

    class FloatOnly(TorchPagedAttention):
        supports_quantized_kv = False
    monkeypatch.setattr(model_runner, "get_attention_backend", lambda device, choice: FloatOnly())
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported by the FloatOnly backend"):
        LLM(model=str(tiny_model_dir), kv_cache_dtype="int8", num_kv_blocks=16, max_model_len=64)
