"""The W8A8 kernel (pagedllm/native/int8_gemm.c): int8 activations per row or per group of features times
per-channel int8 weights.

Reference: dequantize-then-matmul in float64 (the kernel may differ from it only by its float32 rescales),
and the torch formula of :mod:`pagedllm.quantization.w8a8` bit for bit. Every ISA this CPU runs is forced
(``envs.INT8_GEMM_ISA``); the AVX2-only (``-march=haswell``) and plain x86-64 builds run on any x86-64 host.
"""

from __future__ import annotations

import platform

import pytest
import torch

from pagedllm.envs import INT8_GEMM_ISA
from pagedllm.ops import int8_gemm
from pagedllm.quantization.int8 import quantize_per_channel
from pagedllm.quantization.w8a8 import ACTIVATION_GROUP, quantize_activations, w8a8_matmul

IS_X86 = platform.machine() in ("x86_64", "AMD64")
BUILDS = {"native": (), "avx2": ("-march=haswell",), "x86-64": ("-march=x86-64",)}


def _variants():
    """(build, ISA name) pairs: every ISA of the native build, the best of the other builds."""
    return [("native", "avx512_vnni"), ("native", "avx2"), ("native", "scalar"), ("avx2", "avx2"),
            ("x86-64", "scalar")]


@pytest.fixture(scope="module", params=_variants(), ids=lambda v: f"{v[0]}-{v[1]}")
def kernel_isa(request):
    build, name = request.param
    if build != "native" and not IS_X86:
        pytest.skip("x86-64 builds only on x86-64")
    kernel = int8_gemm.load_kernel(BUILDS[build])
    if kernel is None:
        pytest.skip("no C compiler for the int8 GEMM kernel")
    if int8_gemm.ISAS[name] > kernel.best_isa:
        pytest.skip(f"this CPU/build does not run {name}")
    if build == "avx2":
        assert kernel.best_isa == int8_gemm.ISAS["avx2"]
    return kernel, int8_gemm.ISAS[name]


def _weight(n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    q, scales = quantize_per_channel(w)
    b = torch.randn(n, generator=g) if bias else None
    return w, q, scales, b


def _dequantized_activations(x, group):
    """float64 x quantized per row (group None) or per group of ``group`` features, dequantized."""
    xq, sx = quantize_activations(x, group)
    per_feature = sx.double().repeat_interleave(x.shape[1] if group is None else group, dim=1)
    return xq.double() * per_feature[:, :x.shape[1]]


def _dequantized_reference(x, q, scales, b, group):
    """float64 (x quantized, dequantized) @ (q * scales).T + b."""
    out = _dequantized_activations(x, group) @ (q.double() * scales.double()[:, None]).T
    return out if b is None else out + b.double()


@pytest.mark.parametrize("n,k", [(70, 13), (64, 64), (130, 577), (5, 3)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("group", [None, 8, ACTIVATION_GROUP])
def test_matches_dequantized_float64_and_torch_formula(kernel_isa, n, k, bias, group):
    """Column and k tails (N not a multiple of 64, K not of 4), a last activation group shorter than the others
    (577 = 9 * 64 + 1; 13 = 8 + 5), one group per row (None, or a group wider than K); every tile height's row
    tails."""
    kernel, isa = kernel_isa
    w, q, scales, b = _weight(n, k, bias, n + k)
    packed = int8_gemm.pack(q, scales, b, group)
    g = torch.Generator().manual_seed(1)
    for rows in [*range(1, 14), 40]:
        x = torch.randn(rows, k, generator=g) * 3
        out = int8_gemm.int8_linear(x, packed, kernel, isa)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        ref = _dequantized_reference(x, q, scales, b, group)
        # exact int32 sums per group; each group's rescale and add, the channel scale and the bias add round once
        # each in float32
        num_groups = 1 if group is None else -(-k // group)
        bound = (num_groups + 3) * torch.finfo(torch.float32).eps * (ref.abs().max() + 1)
        assert (out.double() - ref).abs().max() <= bound
        assert torch.equal(out, w8a8_matmul(x, q, scales, b, group))


def test_every_row_count_1_to_300(kernel_isa):
    """Rows 1..300 of one input (a small shape, groups of 8 features): each output row equals the row alone."""
    kernel, isa = kernel_isa
    _, q, scales, b = _weight(67, 21, True, 3)
    packed = int8_gemm.pack(q, scales, b, 8)
    x = torch.randn(300, 21, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([int8_gemm.int8_linear(x[i:i + 1], packed, kernel, isa) for i in range(300)])
    ref = w8a8_matmul(x, q, scales, b, 8)
    assert torch.equal(alone, ref)
    for rows in range(1, 301):
        assert torch.equal(int8_gemm.int8_linear(x[:rows], packed, kernel, isa), ref[:rows]), rows


def test_a_group_scale_is_its_own_features_maximum():
    """An outlier feature coarsens only its own group's int8 steps: the features of the other groups are rounded
    to within half of their group's max / 127, far below the outlier's step a per-token scale would give them."""
    x = torch.randn(3, 192)
    x[:, 5] = 1000.0
    xq, sx = quantize_activations(x, 64)
    assert sx.shape == (3, 3)
    assert torch.equal(sx, x.abs().view(3, 3, 64).amax(dim=2) / 127) and (sx[:, 0] == sx[:, 0].max()).all()
    err = (_dequantized_activations(x, 64) - x.double()).abs()[:, 64:]
    assert (err <= sx[:, 1:].double().repeat_interleave(64, dim=1) / 2 * (1 + 1e-6)).all()
    assert (_dequantized_activations(x, None) - x.double()).abs()[:, 64:].max() > 10 * err.max()


def test_an_activation_group_must_be_a_multiple_of_4():
    _, q, scales, _ = _weight(8, 16, False, 2)
    for bad in (0, 6, -4):
        with pytest.raises(ValueError, match="activation_group"):
            int8_gemm.pack(q, scales, None, bad)


def test_quantization_error_bound_against_the_float_weights():
    """Against the unquantized float64 matmul: within the format's rounding, half a step of each
    activation and weight scale per product."""
    w, q, scales, b = _weight(96, 200, False, 5)
    x = torch.randn(9, 200, generator=torch.Generator().manual_seed(6))
    for group in (None, 64):
        out = int8_gemm.int8_linear(x, int8_gemm.pack(q, scales, b, group)) if int8_gemm.load_kernel() else \
            w8a8_matmul(x, q, scales, b, group)
        _, sx = quantize_activations(x, group)
        dx = (sx.double() / 2).repeat_interleave(200 if group is None else group, dim=1)[:, :200]  # (M, K)
        dw = scales.double()[:, None] / 2  # (N, 1)
        bound = x.double().abs() @ dw.expand(-1, 200).T + dx @ w.double().abs().T + dx @ dw.expand(-1, 200).T
        assert ((out.double() - x.double() @ w.double().T).abs() <= bound * 1.0001 + 1e-6).all()


def test_threads_change_no_bits():
    kernel = int8_gemm.load_kernel()
    if kernel is None:
        pytest.skip("no C compiler for the int8 GEMM kernel")
    _, q, scales, b = _weight(2000, 400, True, 7)  # 17 x 2000 x 400 multiply-adds: both threads (kernel_threads)
    packed = int8_gemm.pack(q, scales, b, 64)
    x = torch.randn(17, 400)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int8_gemm.int8_linear(x, packed, kernel)
        torch.set_num_threads(2)
        assert torch.equal(int8_gemm.int8_linear(x, packed, kernel), one)
    finally:
        torch.set_num_threads(before)


def test_zero_rows_and_zero_input():
    kernel = int8_gemm.load_kernel()
    if kernel is None:
        pytest.skip("no C compiler for the int8 GEMM kernel")
    _, q, scales, b = _weight(10, 8, True, 8)
    packed = int8_gemm.pack(q, scales, b)
    assert int8_gemm.int8_linear(torch.zeros(0, 8), packed).shape == (0, 10)
    assert torch.equal(int8_gemm.int8_linear(torch.zeros(2, 8), packed), b.expand(2, -1))


def test_isa_from_the_environment(monkeypatch):
    kernel = int8_gemm.load_kernel()
    if kernel is None:
        pytest.skip("no C compiler for the int8 GEMM kernel")
    try:
        monkeypatch.setenv(INT8_GEMM_ISA.name, "scalar")
        int8_gemm.set_isa(None)
        assert int8_gemm.isa() == 0
        monkeypatch.setenv(INT8_GEMM_ISA.name, "auto")
        int8_gemm.set_isa(None)
        assert int8_gemm.isa() == kernel.best_isa
        if kernel.best_isa < 2:
            with pytest.raises(ValueError, match="avx512_vnni is not available"):
                int8_gemm.set_isa("avx512_vnni")
        with pytest.raises(ValueError, match=INT8_GEMM_ISA.name):
            int8_gemm.set_isa("amx")
    finally:
        monkeypatch.delenv(INT8_GEMM_ISA.name)
        int8_gemm.set_isa(None)


def test_rejects_an_input_that_does_not_fit():
    kernel = int8_gemm.load_kernel()
    if kernel is None:
        pytest.skip("no C compiler for the int8 GEMM kernel")
    _, q, scales, _ = _weight(10, 8, False, 9)
    packed = int8_gemm.pack(q, scales, None)
    with pytest.raises(ValueError, match=r"x must be \(M, 8\) float32"):
        int8_gemm.int8_linear(torch.zeros(2, 9), packed)
    with pytest.raises(ValueError, match="float32"):
        int8_gemm.int8_linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed)


def test_a_weight_of_minus_128_on_every_isa(kernel_isa):
    """A checkpoint's symmetric int8 may hold -128 (AVX2 multiplies |q| by sign(xq, q), so no sign overflows)."""
    kernel, isa = kernel_isa
    q = torch.full((70, 24), -128, dtype=torch.int8)
    q[1::2, ::3] = 127
    scales = torch.rand(70) + 0.5
    packed = int8_gemm.pack(q, scales, None, 8)
    x = torch.randn(9, 24, generator=torch.Generator().manual_seed(11))
    x[0] = -1.0
    out = int8_gemm.int8_linear(x, packed, kernel, isa)
    assert torch.equal(out, w8a8_matmul(x, q, scales, None, 8))
    assert torch.equal(out[0, 0], torch.tensor(1024.0) * scales[0] * 3)  # 3 groups x 8 x (-128) x (-127 steps of 1/127)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_activation_makes_its_rows_outputs_nan(kernel_isa, bad):
    """A NaN or an infinity poisons its own row (as a float matmul would), never the other rows."""
    kernel, isa = kernel_isa
    _, q, scales, b = _weight(40, 24, True, 12)
    packed = int8_gemm.pack(q, scales, b, 8)
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(13))
    x[1, 5] = bad
    out = int8_gemm.int8_linear(x, packed, kernel, isa)
    ref = w8a8_matmul(x, q, scales, b, 8)
    assert out[1].isnan().all() and ref[1].isnan().all()
    assert torch.equal(out[[0, 2]], ref[[0, 2]]) and out[[0, 2]].isfinite().all()


def test_pack_refuses_what_the_kernel_cannot_read():
    _, q, scales, b = _weight(65, 8, True, 14)
    with pytest.raises(ValueError, match="scales and bias"):
        int8_gemm.pack(q, scales[:1], None, 4)
    with pytest.raises(ValueError, match="scales and bias"):
        int8_gemm.pack(q, scales, b[:3], 4)
    with pytest.raises(ValueError, match="int8"):
        int8_gemm.pack(q.to(torch.int16), scales, None, 4)
    with pytest.raises(ValueError, match="in_features > 0"):
        int8_gemm.pack(torch.zeros(4, 0, dtype=torch.int8), torch.ones(4), None)
    with pytest.raises(ValueError, match="activation_group"):
        int8_gemm.pack(q, scales, None, 4.0)
    wide = torch.zeros(1, int8_gemm.MAX_ACTIVATION_GROUP + 4, dtype=torch.int8)
    with pytest.raises(ValueError, match="overflow"):
        int8_gemm.pack(wide, torch.ones(1), None)
    assert int8_gemm.pack(wide, torch.ones(1), None, 64).activation_group == 64
