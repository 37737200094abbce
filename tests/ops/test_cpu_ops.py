"""The fused CPU kernels (pagedllm/ops) against the torch code they replace and transformers' layers.

Bounds, and why:
- float32: a few ulp. RMSNorm sums its squares in another order than torch (its 1/rms then
  differs by an ulp or two, and the output by up to ~4); SiLU/GELU use Cephes-style exp/tanh
  where torch uses SLEEF's (1-2 ulp); the rotation is bit-exact (same products, same FMA).
- bfloat16: equal, or 1 bfloat16 ulp apart where the float32 intermediate (the ~ulp
  differences above) lies next to a bfloat16 rounding boundary; so a few elements at most.
- GELU(tanh) in both dtypes also differs in its negative tail (x < -3), where torch's
  ``0.5 x (1 + tanh(.))`` cancels: both results carry an absolute error of about one float32 ulp of
  0.5 |x| there, so the bound adds ``2**-22 |x|`` times |up|.
The torch code is the layer with ``PAGEDLLM_CPU_FUSED_OPS=0``, which must give that code exactly.
"""

from __future__ import annotations

import ctypes
import functools
import os
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from pagedllm import native
from pagedllm.models.layers import GatedMLP, GemmaRMSNorm, RMSNorm, RotaryEmbedding
from pagedllm.envs import CPU_FUSED_OPS
from pagedllm.ops import act_and_mul, cpu_ops, fused_add_rms_norm_, library, rms_norm, rope_qk, set_enabled
from pagedllm.ops.library import CpuOps

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="no C compiler: the fused CPU kernels are not built")

DTYPES = [torch.float32, torch.bfloat16]


@contextmanager
def torch_code():
    """Run the layers' torch code (the fused kernels switched off) inside the block."""
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(None)


def f32_ulp(x: torch.Tensor) -> torch.Tensor:
    """float32 ulp of each |x| (the smallest subnormal for zeros)."""
    a = x.abs().float()
    return torch.nextafter(a, torch.tensor(float("inf"))) - a


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 ulp of each |x|, as float32."""
    a = x.abs().float()
    exponent = torch.frexp(a.clamp_min(2.0 ** -126)).exponent  # a = m * 2**e, 0.5 <= m < 1
    return torch.ldexp(torch.ones_like(a), exponent - 8)


def assert_close_ulps(got: torch.Tensor, ref: torch.Tensor, ulps: float, extra: torch.Tensor | float = 0.0):
    """|got - ref| <= ulps * ulp(ref) + extra elementwise (ulp of got's dtype); dtypes and shapes equal."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    ulp = f32_ulp(ref) if ref.dtype == torch.float32 else bf16_ulp(ref)
    err = (got.float() - ref.float()).abs()
    bound = ulps * ulp + extra
    worst = (err - bound).argmax()
    assert (err <= bound).all(), f"{got.flatten()[worst]} vs {ref.flatten()[worst]}"


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def make_norm(cls, dim: int, dtype: torch.dtype, seed: int = 1):
    norm = cls(dim, 1e-6).to(dtype).requires_grad_(False)
    norm.weight.copy_(randn(dim, scale=0.3, seed=seed) + (0.0 if cls is GemmaRMSNorm else 1.0))
    return norm


# -- RMSNorm ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("dim", [576, 100])  # SmolLM2's width; a width that is not a multiple of 16
def test_add_rms_norm_matches_torch_code(cls, dtype, dim):
    norm = make_norm(cls, dim, dtype)
    x, residual = randn(300, dim, dtype=dtype, scale=3), randn(300, dim, dtype=dtype, scale=3, seed=2)
    with torch_code():
        ref_out, ref_residual = norm(x, residual)
    x_in, res_in = x.clone(), residual.clone()
    out, new_residual = norm(x_in, res_in)
    assert out is x_in and new_residual is res_in  # in place, as vLLM's fused_add_rms_norm
    assert torch.equal(new_residual, ref_residual)  # the add rounds exactly as torch's
    assert_close_ulps(out, ref_out, 6 if dtype == torch.float32 else 1)
    if dtype == torch.bfloat16:
        assert (out != ref_out).sum() <= out.numel() // 1000


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [GemmaRMSNorm, RMSNorm])
@pytest.mark.parametrize("with_next", [True, False])
def test_add_normed_matches_torch_code(cls, dtype, with_next):
    """Gemma's post-norm + residual add (+ the next pre-norm) in one kernel. The sum now adds a
    normed value that may differ by its few ulp, so the bound adds that value's ulps."""
    post, pre = make_norm(cls, 640, dtype, seed=4), make_norm(cls, 640, dtype, seed=5)
    x, residual = randn(50, 640, dtype=dtype, scale=3), randn(50, 640, dtype=dtype, scale=3, seed=2)
    with torch_code():
        ref_next, ref_residual = post.add_normed(x, residual, pre if with_next else None)
        ref_normed = post(x)
    x_in, res_in = x.clone(), residual.clone()
    got_next, got_residual = post.add_normed(x_in, res_in, pre if with_next else None)
    assert got_residual is res_in and (got_next is x_in if with_next else got_next is None)
    is_f32 = dtype == torch.float32
    normed_ulp = 6 * f32_ulp(ref_normed) if is_f32 else bf16_ulp(ref_normed)
    assert_close_ulps(got_residual, ref_residual, 1, normed_ulp)
    if with_next:  # the next norm of a sum that moved by the bound above
        scale = ref_next.float().abs().amax(dim=-1, keepdim=True)
        assert_close_ulps(got_next, ref_next, 8 if is_f32 else 1, 8 * f32_ulp(scale) if is_f32 else bf16_ulp(scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
def test_rms_norm_without_residual_and_strided_rows(cls, dtype):
    norm = make_norm(cls, 64, dtype)
    wide = randn(40, 96, dtype=dtype, scale=2)
    for x in (wide[:, :64], randn(5, 8, 64, dtype=dtype, seed=3)):  # rows at stride 96; a 3-D batch
        with torch_code():
            ref = norm(x)
        before = x.clone()
        out = norm(x)
        assert out.is_contiguous() and torch.equal(x, before)  # a new tensor, x untouched
        assert_close_ulps(out, ref, 6 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("dim", [576, 100])
def test_rms_norm_matches_transformers_layers(dim):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = randn(64, dim, scale=3)
    for ours, theirs in ((make_norm(RMSNorm, dim, torch.float32), LlamaRMSNorm(dim, eps=1e-6)),
                         (make_norm(GemmaRMSNorm, dim, torch.float32), Gemma3RMSNorm(dim, eps=1e-6))):
        theirs.weight.data.copy_(ours.weight)
        with torch.no_grad():
            assert_close_ulps(ours(x), theirs(x), 6)


def test_environment_switch_gives_torch_code(monkeypatch):
    """PAGEDLLM_CPU_FUSED_OPS=0 (read at the first kernel call, or again after set_enabled(None))."""
    norm = make_norm(RMSNorm, 64, torch.float32)
    x, residual = randn(4, 64), randn(4, 64, seed=2)
    out, _ = norm(x, residual)
    assert out is x  # the kernel wrote in place
    monkeypatch.setenv(CPU_FUSED_OPS.name, "0")
    set_enabled(None)
    try:
        assert cpu_ops() is None and rms_norm(x, norm.weight, 1e-6, False) is None
        x2, residual2 = randn(4, 64), randn(4, 64, seed=2)
        out, new_residual = norm(x2, residual2)
    finally:
        monkeypatch.delenv(CPU_FUSED_OPS.name)
        set_enabled(None)
    assert cpu_ops() is not None
    assert out is not x2 and new_residual is not residual2  # torch's out-of-place code
    expected_residual = x2 + residual2
    assert torch.equal(new_residual, expected_residual)
    assert torch.equal(out, F.rms_norm(expected_residual, (64,), eps=1e-6) * norm.weight)


def test_unsupported_inputs_fall_back_to_torch_code():
    w = torch.ones(64)
    assert rms_norm(randn(4, 64, dtype=torch.float16), w.half(), 1e-6, False) is None  # float16
    assert rms_norm(randn(4, 64), w.bfloat16(), 1e-6, False) is None  # weight of another dtype
    assert rms_norm(randn(4, 128)[:, ::2], w, 1e-6, False) is None  # no unit last stride
    with torch.enable_grad():
        assert rms_norm(randn(4, 64).requires_grad_(), w, 1e-6, False) is None  # autograd must see the ops
    assert not fused_add_rms_norm_(randn(4, 64), randn(4, 64, dtype=torch.bfloat16), w, 1e-6, False)
    assert act_and_mul(randn(4, 64), "relu") is None  # not a fused activation
    assert act_and_mul(randn(4, 63), "silu") is None
    norm = make_norm(RMSNorm, 64, torch.float16)  # the layer still works, through torch
    assert norm(randn(4, 64, dtype=torch.float16)).dtype == torch.float16


# -- gated activations ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("inter", [1536, 37])
def test_act_and_mul_matches_torch_code(activation, dtype, inter):
    mlp = GatedMLP(8, inter, activation)
    gate_up = randn(70, 2 * inter, dtype=dtype, scale=4)
    with torch_code():
        gate, up = gate_up.chunk(2, dim=-1)
        ref = mlp.act(gate) * up
    out = act_and_mul(gate_up, activation)
    tail = 0.0
    if activation == "gelu_pytorch_tanh":  # torch's formula cancels for x < -3 (module docstring)
        tail = 2.0 ** -22 * (gate.float().abs() * up.float().abs())
    assert_close_ulps(out, ref, 4 if dtype == torch.float32 else 1, tail)
    if dtype == torch.bfloat16 and activation == "silu":
        assert (out != ref).sum() <= out.numel() // 1000


def test_act_and_mul_matches_transformers_activations():
    from transformers.activations import ACT2FN

    gate_up = randn(16, 2 * 96, scale=4)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close_ulps(act_and_mul(gate_up, "silu"), ACT2FN["silu"](gate) * up, 4)
    assert_close_ulps(act_and_mul(gate_up, "gelu_pytorch_tanh"), ACT2FN["gelu_pytorch_tanh"](gate) * up, 4,
                      2.0 ** -22 * gate.abs() * up.abs())


def test_act_special_values():
    """Far tails and non-finite gates behave like torch's SiLU (exp overflow/underflow)."""
    gate = torch.tensor([-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0, float("inf"), float("-inf"),
                         float("nan")] + [1.0] * 6)
    gate_up = torch.cat([gate, torch.ones(16)]).unsqueeze(0)
    out = act_and_mul(gate_up, "silu")[0]
    ref = F.silu(gate)
    assert torch.equal(out.isnan(), ref.isnan())
    finite = ~ref.isnan()
    assert torch.allclose(out[finite], ref[finite], rtol=1e-6, atol=1e-30)


def test_mlp_uses_the_kernel_and_switch_gives_torch_code(monkeypatch):
    mlp = GatedMLP(16, 32, "silu").requires_grad_(False)
    calls = []
    from pagedllm.models.layers import activation as activation_module
    real = activation_module.act_and_mul
    monkeypatch.setattr(activation_module, "act_and_mul", lambda *a: calls.append(1) or real(*a))
    x = randn(3, 16)
    fused = mlp(x)
    assert calls and real(mlp.gate_up_proj(x), "silu") is not None
    with torch_code():
        gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
        reference = mlp(x)
    assert torch.equal(reference, mlp.down_proj(F.silu(gate) * up))
    assert_close_ulps(fused, reference, 64)


# -- rotary (+ per-head q/k norm) ----------------------------------------------------------------

def rotary_case(dtype, head_dim=64, rotary_dim=64, num_tokens=33, num_heads=9, num_kv_heads=3, seed=0):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    emb = RotaryEmbedding(inv_freq, 1.0, 4096, dtype, torch.device("cpu"))
    positions = torch.randint(0, 4096, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, scale=2, seed=seed)
    return emb, positions, qkv


def torch_rotary(qkv, cos_sin, num_heads, num_kv_heads, head_dim, q_norm=None, k_norm=None):
    """SelfAttention's torch code: per-head norms, then RotaryEmbedding.apply on q and k."""
    qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(-1, num_heads + num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        qk = torch.cat([q_norm(q), k_norm(k)], dim=1)
    return RotaryEmbedding.apply(qk, cos_sin).split([num_heads, num_kv_heads], dim=1)


def run_fused_rotary(qkv, cos_sin, num_heads, num_kv_heads, head_dim, q_norm=None, k_norm=None):
    qkv = qkv.clone()
    before = qkv.clone()
    weights = (q_norm.weight, k_norm.weight, q_norm.eps, q_norm.gemma_convention) if q_norm is not None else ()
    q = rope_qk(qkv, cos_sin, num_heads, num_kv_heads, head_dim, *weights)
    assert q is not None and q.is_contiguous() and q.shape == (qkv.shape[0], num_heads, head_dim)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    assert torch.equal(qkv[:, :q_size], before[:, :q_size])  # q's input rows untouched
    assert torch.equal(qkv[:, q_size + kv_size:], before[:, q_size + kv_size:])  # v untouched
    return q, qkv[:, q_size:q_size + kv_size].view(-1, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (64, 32), (80, 40)])  # full, partial
def test_rope_qk_is_bit_exact(dtype, head_dim, rotary_dim):
    emb, positions, qkv = rotary_case(dtype, head_dim, rotary_dim)
    cos_sin = emb.lookup(positions)
    ref_q, ref_k = torch_rotary(qkv, cos_sin, 9, 3, head_dim)
    q, k = run_fused_rotary(qkv, cos_sin, 9, 3, head_dim)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls,head_dim", [(RMSNorm, 128), (GemmaRMSNorm, 256), (RMSNorm, 40)])
def test_rope_qk_with_head_norms_matches_torch_code(dtype, cls, head_dim):
    """Qwen 3 (RMSNorm) and Gemma 3 ((1 + w)) per-head norms. The rotation's cancellation turns the
    norm's few-ulp differences into errors relative to the head's scale, not to each element."""
    emb, positions, qkv = rotary_case(dtype, head_dim, head_dim, num_heads=4, num_kv_heads=2)
    cos_sin = emb.lookup(positions)
    q_norm, k_norm = make_norm(cls, head_dim, dtype, seed=5), make_norm(cls, head_dim, dtype, seed=6)
    with torch_code():
        ref = torch_rotary(qkv, cos_sin, 4, 2, head_dim, q_norm, k_norm)
    got = run_fused_rotary(qkv, cos_sin, 4, 2, head_dim, q_norm, k_norm)
    for g, r in zip(got, ref):
        scale = r.float().abs().amax(dim=-1, keepdim=True)
        if dtype == torch.float32:
            assert_close_ulps(g, r, 0, 16 * f32_ulp(scale))
        else:
            assert_close_ulps(g, r, 1, bf16_ulp(scale))
            assert (g != r).sum() <= g.numel() // 200


def test_rope_qk_matches_transformers_rotation():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    emb, positions, qkv = rotary_case(torch.float32, 64, 64)
    q, k = run_fused_rotary(qkv, emb.lookup(positions), 9, 3, 64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    freqs = torch.outer(positions.float(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    hf_q, hf_k = apply_rotary_pos_emb(qkv[:, :9 * 64].view(-1, 9, 64), qkv[:, 9 * 64:12 * 64].view(-1, 3, 64),
                                      cos, sin, unsqueeze_dim=1)  # (T, heads, head_dim) layout
    # transformers computes cos/sin per call, the table once: the same values to an ulp of the inputs
    assert_close_ulps(q, hf_q, 0, 4 * f32_ulp(torch.tensor(8.0)))
    assert_close_ulps(k, hf_k, 0, 4 * f32_ulp(torch.tensor(8.0)))


def test_rope_qk_rejects_what_it_cannot_take():
    emb, positions, qkv = rotary_case(torch.float32)
    cos_sin = emb.lookup(positions)
    assert rope_qk(qkv.half(), cos_sin.half(), 9, 3, 64) is None  # float16
    assert rope_qk(qkv, cos_sin.bfloat16(), 9, 3, 64) is None  # table of another dtype
    assert rope_qk(qkv[:, :-64], cos_sin, 9, 3, 64) is None  # wrong width
    assert rope_qk(qkv, cos_sin[:-1], 9, 3, 64) is None  # a row per token
    assert rope_qk(qkv, cos_sin, 9, 3, 64, torch.ones(64), None) is None  # both norm weights or neither


# -- whole models -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_model_forward_with_and_without_kernels(dtype):
    """A tiny Qwen 3 (q/k norms, SwiGLU) through prefill: logits with the kernels agree with the
    torch code's (float32: to rounding; bfloat16: within what bfloat16 rounding moves them)."""
    from transformers import Qwen3Config

    from pagedllm.attention.backend import set_forward_context
    from pagedllm.models.qwen3 import Qwen3ForCausalLM
    from tests.model_utils import random_llama_weights

    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                         rms_norm_eps=1e-6, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config, dtype=dtype)
    weights = dict(random_llama_weights(config, seed=0))
    weights.update({f"model.layers.{i}.self_attn.{n}_norm.weight": 1 + 0.2 * randn(32, seed=i)
                    for i in range(2) for n in "qk"})
    model.load_weights(weights.items())
    ids, positions = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0)), torch.arange(20)

    def logits():
        with torch.inference_mode(), set_forward_context(None):
            return model.compute_logits(model(ids, positions))

    fused = logits()
    with torch_code():
        reference = logits()
    tol = 1e-4 if dtype == torch.float32 else 0.15
    assert (fused - reference).abs().max().item() < tol
    assert torch.equal(fused.argmax(-1), reference.argmax(-1))


def test_results_do_not_depend_on_the_thread_count():
    """Rows are split between OpenMP threads; each row is computed in one fixed order, so a
    prefill-sized call on two threads gives the bits of one thread."""
    from pagedllm.ops.library import num_threads_for

    x, residual, w = randn(1100, 576, scale=3), randn(1100, 576, seed=2), randn(576, seed=3)
    gate_up = randn(400, 2 * 1536, scale=4, seed=4)
    emb, positions, qkv = rotary_case(torch.float32, num_tokens=600)
    cos_sin = emb.lookup(positions)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert num_threads_for(x.numel()) == n
            xs, rs, qkvs = x.clone(), residual.clone(), qkv.clone()
            assert fused_add_rms_norm_(xs, rs, w, 1e-6, False)
            results.append((xs, rs, act_and_mul(gate_up, "silu"), rope_qk(qkvs, cos_sin, 9, 3, 64), qkvs))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_torch_compile_traces_the_torch_code():
    """Under torch.compile the kernels step aside (a ctypes call would break the graph): the
    layers trace as one graph and compute what they compute eagerly, to a few ulp."""
    norm = make_norm(RMSNorm, 64, torch.float32)
    mlp = GatedMLP(64, 96, "silu").requires_grad_(False)
    mlp.gate_up_proj.weight.copy_(randn(192, 64, scale=0.1, seed=7))
    mlp.down_proj.weight.copy_(randn(64, 96, scale=0.1, seed=8))

    def layer(x, residual):
        hidden, residual = norm(x, residual)
        return mlp(hidden), residual

    x, residual = randn(8, 64), randn(8, 64, seed=2)
    with torch.no_grad():
        eager = layer(x.clone(), residual.clone())
        compiled = torch.compile(layer, backend="eager", fullgraph=True)(x.clone(), residual.clone())
    for a, b in zip(compiled, eager):
        assert_close_ulps(a, b, 64, 64 * f32_ulp(b.abs().amax()))


# -- the bfloat16 rounding paths (pagedllm/native/native_simd.h) ----------------------------------------
# A host with AVX512-BF16 rounds with vcvtneps2bf16 and sends vectors holding a NaN or a subnormal
# to the exact integer path; other hosts (AVX-512 without BF16, AVX2-only) use the integer path
# everywhere. Each build below must give the bits of the integer path ("exact") on inputs full of
# the values where the instruction and torch's rule differ or where rounding is delicate.

BUILDS = {"native": (), "exact": ("-DPAGEDLLM_NO_AVX512BF16",), "avx2": ("-march=haswell",)}
BF16_MAX = 3.3895313892515355e38


@functools.cache
def ops_built_with(build: str) -> CpuOps:
    return CpuOps(ctypes.CDLL(str(native.build_library(library._SOURCE, BUILDS[build]))))


@contextmanager
def using_build(build: str):
    saved = list(library._ops)
    library._ops[:] = [ops_built_with(build)]
    try:
        yield
    finally:
        library._ops[:] = saved


def special_bf16(rows: int, dim: int, seed: int) -> torch.Tensor:
    """Random bfloat16 rows with subnormals, NaN, +-inf, +-max finite, +-0 and values one half
    bfloat16 ulp apart (sums that tie) scattered over every row but the last two (finite ones)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g)
    specials = torch.tensor([1e-39, -3e-40, 2.0 ** -133, 2.0 ** -126, float("nan"), float("inf"), float("-inf"),
                             BF16_MAX, -BF16_MAX, 0.0, -0.0, 1.0, 1.0078125, 2.0 ** 119, 0.00390625])
    for r in range(rows - 2):
        cols = torch.randperm(dim, generator=g)[:6]
        x[r, cols] = specials[torch.randint(0, len(specials), (6,), generator=g)]
    return x.bfloat16()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def test_the_native_build_reports_its_rounding_path():
    has_bf16 = "avx512_bf16" in open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else False
    lib = ops_built_with("native")._lib
    assert lib.pagedllm_cpu_ops_avx512bf16() == int(has_bf16)
    assert ops_built_with("exact")._lib.pagedllm_cpu_ops_avx512bf16() == 0
    assert ops_built_with("avx2")._lib.pagedllm_cpu_ops_avx512bf16() == 0


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("gemma", [False, True])
def test_add_rms_norm_rounding_paths_give_the_same_bits(build, gemma):
    x, residual = special_bf16(12, 576, seed=1), special_bf16(12, 576, seed=2)
    residual[:, :8] = torch.tensor([1.0, 1.0078125, BF16_MAX, 1e-39, 2.0 ** -126, -2.0 ** -126, 1.0, 3.0])
    x[:, :8] = torch.tensor([0.00390625, 0.00390625, 2.0 ** 119, 0.0, -2.0 ** -126 * 1.0078125, 1e-39, 2.0 ** -9,
                             0.01171875])  # ties to even (down, up), to inf, subnormal sums
    w = randn(576, scale=0.3, seed=3).bfloat16() + (0 if gemma else 1)
    results = {}
    for b in (build, "exact"):
        xs, rs = x.clone(), residual.clone()
        with using_build(b):
            assert fused_add_rms_norm_(xs, rs, w, 1e-6, gemma)
            plain = rms_norm(x, w, 1e-6, gemma)
        results[b] = (bits(xs), bits(rs), bits(plain))
    assert all(torch.equal(a, e) for a, e in zip(results[build], results["exact"]))
    # the residual add is one rounding of a float32 sum, torch's exactly (NaN lanes aside)
    ref = x + residual
    assert torch.equal(rs_nan := residual.add(x).isnan(), ref.isnan())
    got = results["exact"][1].view(torch.bfloat16)
    assert torch.equal(bits(got)[~rs_nan], bits(ref)[~rs_nan])


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_act_and_mul_rounding_paths_give_the_same_bits(build, activation):
    gate_up = torch.cat([special_bf16(10, 1536, seed=4), special_bf16(10, 1536, seed=5)], dim=1)
    gate_up[:, :4] = torch.tensor([1e-39, -1e-39, 2.0 ** -126, -2.0 ** -120])  # act(.) subnormal
    results = {}
    for b in (build, "exact"):
        with using_build(b):
            results[b] = bits(act_and_mul(gate_up, activation))
    assert torch.equal(results[build], results["exact"])


@pytest.mark.parametrize("build", ["native", "exact", "avx2"])
def test_rope_qk_rounding_paths_are_torch_bits(build):
    emb, positions, _ = rotary_case(torch.bfloat16)
    qkv = special_bf16(33, (9 + 2 * 3) * 64, seed=6)
    qkv[-2:] = qkv[-2:] * 1e-37  # products and sums that are subnormal
    cos_sin = emb.lookup(positions)
    ref_q, ref_k = torch_rotary(qkv, cos_sin, 9, 3, 64)
    fused = qkv.clone()
    with using_build(build):
        q = rope_qk(fused, cos_sin, 9, 3, 64)
    k = fused[:, 9 * 64:12 * 64].view(-1, 3, 64)
    for got, ref in ((q, ref_q), (k, ref_k)):
        nan = ref.isnan()
        assert torch.equal(got.isnan(), nan)  # torch's vector path stores NaN as 0xffff, the kernels 0x7fc0
        assert torch.equal(bits(got)[~nan], bits(ref)[~nan])
