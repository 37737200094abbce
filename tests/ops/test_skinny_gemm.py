"""The skinny GEMM (pagedllm/native/skinny_gemm.c): float32 linears of a decode step's few rows.

Reference: the float64 matmul of the same float32 inputs. Both builds run on every host: the
native one (AVX-512 where the CPU has it) and ``-march=haswell`` (AVX2, the other tile shape).
Batch invariance is checked bit for bit: a row's output alone, in any batch, with any thread count.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.envs import SKINNY_GEMM
from pagedllm.models.layers.linear import Linear
from pagedllm.ops import skinny_gemm

BUILDS = {"native": (), "avx2": ("-march=haswell",)}


@pytest.fixture(scope="module", params=list(BUILDS))
def kernel(request):
    k = skinny_gemm.load_kernel(BUILDS[request.param])
    if k is None:
        pytest.skip("no C compiler for the skinny GEMM kernel")
    return k


@pytest.fixture
def kernel_on():
    """The kernel switched on for this test on any CPU (off by default on AVX2-only hosts)."""
    skinny_gemm.set_enabled(True)
    if not skinny_gemm.enabled():
        pytest.skip("the skinny GEMM kernel cannot be built here")
    yield
    skinny_gemm.set_enabled(None)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out + b.double() if b is not None else out


def tolerance(x: torch.Tensor, w: torch.Tensor) -> float:
    """float32 summation of K products: a few ulp of the sum of |products|."""
    return 4 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T).max().item() + 1e-30


@pytest.mark.parametrize("n,k", [(96, 64), (50, 37), (5, 3), (1000, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference(kernel, n, k, bias):
    """Column tails (N not a multiple of the panel width), every row tail of both tile heights
    (1..17 rows, then several tiles), odd K."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = skinny_gemm.pack_panels(w, b, kernel.panel_width)
    for rows in [*range(1, 18), 64, 129]:
        x = torch.randn(rows, k, generator=g)
        out = skinny_gemm.skinny_linear(x, packed, kernel)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        err = (out.double() - reference(x, w, b)).abs().max().item()
        assert err <= tolerance(x, w), f"{rows} rows: error {err}"


def test_strided_rows_and_zero_rows(kernel):
    """x may be a row slice of a wider tensor (row stride > K); M = 0 gives an empty result."""
    g = torch.Generator().manual_seed(3)
    wide, w = torch.randn(12, 200, generator=g), torch.randn(70, 64, generator=g)
    x = wide[:, 10:74]
    assert x.stride() == (200, 1)
    packed = skinny_gemm.pack_panels(w, None, kernel.panel_width)
    out = skinny_gemm.skinny_linear(x, packed, kernel)
    assert (out.double() - reference(x, w, None)).abs().max().item() <= tolerance(x, w)
    assert skinny_gemm.skinny_linear(x[:0], packed, kernel).shape == (0, 70)


def test_special_values_propagate(kernel):
    """inf and NaN in x reach exactly the outputs they feed (no masking, no flush)."""
    w = torch.ones(40, 16)
    x = torch.zeros(3, 16)
    x[0, 5] = float("inf")
    x[1, 2] = float("nan")
    x[2, 0] = 1e-40  # subnormal: kept (FMA does not flush without -ffast-math)
    out = skinny_gemm.skinny_linear(x, skinny_gemm.pack_panels(w, None, kernel.panel_width), kernel)
    assert torch.isinf(out[0]).all() and torch.isnan(out[1]).all()
    assert (out[2] == torch.tensor(1e-40)).all()


def test_rows_are_batch_invariant_bit_for_bit(kernel):
    """Each row's output is the same bits alone, in a batch of any size, and with 1 or 2 threads."""
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(37, 576, generator=g), torch.randn(200, 576, generator=g), torch.randn(200, generator=g)
    packed = skinny_gemm.pack_panels(w, b, kernel.panel_width)
    assert_batch_invariant(x, packed, kernel, singles=(0, 7, 8, 36), part=(5, 30))


def assert_batch_invariant(x, packed, kernel, singles: tuple[int, ...], part: tuple[int, int]) -> None:
    """Rows ``singles`` alone and rows ``part`` give the bits they have in the whole batch, which
    one thread gives too."""
    full = skinny_gemm.skinny_linear(x, packed, kernel)
    for i in singles:
        assert torch.equal(skinny_gemm.skinny_linear(x[i:i + 1], packed, kernel), full[i:i + 1]), f"row {i}"
    assert torch.equal(skinny_gemm.skinny_linear(x[part[0]:part[1]], packed, kernel), full[part[0]:part[1]])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(skinny_gemm.skinny_linear(x, packed, kernel), full)
    finally:
        torch.set_num_threads(threads)


def test_bad_input_is_a_value_error(kernel):
    packed = skinny_gemm.pack_panels(torch.randn(8, 16), None, kernel.panel_width)
    for bad in (torch.randn(2, 15), torch.randn(2, 16, dtype=torch.float64), torch.randn(16, 2).T, torch.randn(16)):
        with pytest.raises(ValueError, match="skinny_linear: x must be"):
            skinny_gemm.skinny_linear(bad, packed, kernel)


def test_pack_applies_to_cpu_weights_of_its_dtypes_only(kernel_on):
    assert skinny_gemm.pack(torch.randn(8, 16)).dtype == torch.float32
    assert skinny_gemm.pack(torch.randn(8, 16, dtype=torch.float16)) is None
    assert skinny_gemm.pack(torch.randn(8)) is None
    kernel = skinny_gemm.load_kernel()
    bf16 = skinny_gemm.pack(torch.randn(8, 64, dtype=torch.bfloat16))
    assert (bf16 is not None) == (kernel.amx or kernel.bf16_dp)
    if kernel.amx:
        assert bf16.layout == "amx" and skinny_gemm.pack(torch.randn(8, 48, dtype=torch.bfloat16)) is None  # K % 32
    elif kernel.bf16_dp:
        assert bf16.layout == "bf16_pairs" and skinny_gemm.pack(torch.randn(8, 48, dtype=torch.bfloat16)) is not None
        assert skinny_gemm.pack(torch.randn(8, 47, dtype=torch.bfloat16)) is None  # odd K
    skinny_gemm.set_enabled(False)
    assert skinny_gemm.pack(torch.randn(8, 16)) is None
    assert skinny_gemm.pack(torch.randn(8, 64, dtype=torch.bfloat16)) is None


def test_env_switch_is_checked(monkeypatch):
    skinny_gemm.set_enabled(None)
    monkeypatch.setenv(SKINNY_GEMM.name, "yes")
    try:
        with pytest.raises(ValueError, match="PAGEDLLM_SKINNY_GEMM must be one of '', '0', '1', got 'yes'"):
            skinny_gemm.enabled()
        monkeypatch.setenv(SKINNY_GEMM.name, "0")
        assert not skinny_gemm.enabled()
    finally:
        skinny_gemm.set_enabled(None)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("onednn_rows", [False, True])
def test_linear_uses_it_for_decode_rows_and_torch_above(kernel_on, monkeypatch, bias, onednn_rows):
    """A packed float32 Linear runs the kernel up to MAX_ROWS rows and F.linear above (or, where
    ``fp32_rows_use_onednn``: CPUs whose MKL is slow, oneDNN's packed copy); all match the float64
    reference; grad-tracked inputs keep autograd; unpack goes back to F.linear."""
    from pagedllm.models.layers import linear as linear_module

    if onednn_rows and not torch.backends.mkldnn.is_available():
        pytest.skip("needs oneDNN")
    monkeypatch.setattr(linear_module, "fp32_rows_use_onednn", lambda: onednn_rows)
    torch.manual_seed(0)
    layer = Linear(64, 100, bias=bias)
    assert layer.pack_for_cpu(64) and layer.skinny_weight is not None
    assert (layer.packed_weight is not None) == onednn_rows
    calls = []
    original = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    w, b = layer.weight.detach(), layer.bias.detach() if bias else None
    with torch.no_grad():
        for rows in (1, skinny_gemm.MAX_ROWS, skinny_gemm.MAX_ROWS + 1):
            x = torch.randn(rows, 64)
            assert (layer(x).double() - reference(x, w, b)).abs().max().item() <= tolerance(x, w) + 1e-6
    assert calls == [1, skinny_gemm.MAX_ROWS]
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()  # F.linear: the packed copy has no autograd link
    assert x.grad is not None and len(calls) == 2
    layer.unpack()
    assert not layer.is_packed


def test_bf16_math_and_bfloat16_weights_keep_onednn(kernel_on):
    """bf16_math needs oneDNN's copy (the bfloat16 math is a oneDNN setting); bfloat16 weights keep it
    for rows above MAX_ROWS_BF16."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("needs oneDNN")
    from pagedllm.models.layers.linear import bf16_math_supported, onednn_packs

    fp32 = Linear(32, 48)
    assert fp32.pack_for_cpu(64, bf16_math=True)
    if bf16_math_supported():
        assert fp32.bf16_math and fp32.packed_weight is not None and fp32.skinny_weight is None
    else:  # refused without AMX: packed as without the opt-in, the skinny GEMM for decode rows
        assert not fp32.bf16_math and fp32.skinny_weight is not None
    bf16 = Linear(32, 48).to(torch.bfloat16)  # oneDNN's copy for prefill rows, the skinny one beside it
    kernel = skinny_gemm.load_kernel()
    has_skinny = kernel.amx or kernel.bf16_dp
    # an AVX2-only CPU has neither: oneDNN refuses bfloat16 there and the weight stays on F.linear
    assert bf16.pack_for_cpu(64) == (onednn_packs(torch.bfloat16) or has_skinny)
    assert (bf16.packed_weight is not None) == onednn_packs(torch.bfloat16)
    assert (bf16.skinny_weight is not None) == has_skinny
    assert onednn_packs(torch.float32) and onednn_packs(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_calls_show_in_torch_profiler_as_a_matmul(kernel):
    """Under torch's profiler a call is a range named PROFILER_EVENT (test_benchmarks checks the step
    profile counts that name as matmul time; it would otherwise be counted as Python)."""
    packed = skinny_gemm.pack_panels(torch.randn(64, 32), None, kernel.panel_width)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        skinny_gemm.skinny_linear(torch.randn(4, 32), packed, kernel)
    assert skinny_gemm.PROFILER_EVENT in {e.key for e in prof.key_averages()}


# ---- bfloat16: AMX, or AVX512-BF16's vdpbf16ps without it ------------------------------------

BF16_KERNELS = {"amx": (skinny_gemm.pack_panels_bf16, skinny_gemm.MAX_ROWS_BF16),
                "bf16_pairs": (skinny_gemm.pack_panels_bf16_pairs, skinny_gemm.MAX_ROWS_BF16_DP)}


@pytest.fixture(scope="module", params=list(BF16_KERNELS))
def bf16_kernel(request):
    """(kernel, pack function) of each bfloat16 kernel this host runs: AMX where granted, the
    AVX512-BF16 one where the native build has it (both on a CPU with both)."""
    k = skinny_gemm.load_kernel()
    if k is None or not (k.amx if request.param == "amx" else k.bf16_dp):
        pytest.skip(f"no {request.param} bfloat16 kernel on this CPU (or no C compiler)")
    return k, BF16_KERNELS[request.param][0]


def assert_bf16_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                      what: str) -> None:
    """out is the exact result rounded to bfloat16, up to the float32 accumulation: within one
    bfloat16 ulp plus the float32 summation bound of it, and the nearest bfloat16 in all but a few
    elements (those whose exact value lies within that bound of a rounding boundary)."""
    ref = reference(x, w, b)
    assert out.dtype == torch.bfloat16
    nearest = ref.float().bfloat16()
    ulp = (nearest.double().abs() * 2.0 ** -7).clamp_min(2.0 ** -133)
    err = (out.double() - ref).abs()
    assert (err <= ulp + tolerance(x, w)).all(), f"{what}: error {err.max().item()} beyond one bfloat16 ulp"
    off = (out != nearest).sum().item()
    assert off <= max(2, out.numel() // 200), f"{what}: {off} of {out.numel()} elements not the nearest bfloat16"


@pytest.mark.parametrize("n,k", [(96, 64), (50, 32), (77, 96), (1000, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_matches_float64_reference(bf16_kernel, n, k, bias):
    """Column tails (N not a multiple of the panel), every row tail of a tile, several tiles or
    walks (> 32 rows), rows not a multiple of 16 (the AMX caller pads x)."""
    kernel, pack = bf16_kernel
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    packed = pack(w, b)
    for rows in [*range(1, 18), 31, 32, 33, 48, 100, 256]:
        x = torch.randn(rows, k, generator=g).bfloat16()
        out = skinny_gemm.skinny_linear(x, packed, kernel)
        assert out.shape == (rows, n)
        assert_bf16_close(out, x, w, b, f"{rows} rows")


def test_bf16_rows_are_batch_invariant_bit_for_bit(bf16_kernel):
    kernel, pack = bf16_kernel
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(45, 576, generator=g).bfloat16(), torch.randn(200, 576, generator=g).bfloat16()
    packed = pack(w, torch.randn(200, generator=g))
    assert_batch_invariant(x, packed, kernel, singles=(0, 7, 8, 15, 16, 31, 32, 44), part=(3, 40))


def test_bf16_strided_rows_special_values_and_bad_input(bf16_kernel):
    kernel, pack = bf16_kernel
    g = torch.Generator().manual_seed(9)
    wide, w = torch.randn(20, 200, generator=g).bfloat16(), torch.randn(40, 64, generator=g).bfloat16()
    x = wide[:, 8:72]  # row stride 200, 20 rows (padded to 32 by the AMX caller)
    packed = pack(w, None)
    assert_bf16_close(skinny_gemm.skinny_linear(x, packed, kernel), x, w, None, "strided")
    special = torch.zeros(3, 64).bfloat16()
    special[0, 5], special[1, 2] = float("inf"), float("nan")
    out = skinny_gemm.skinny_linear(special, pack(torch.ones(40, 64).bfloat16(), None), kernel)
    assert torch.isinf(out[0]).all() and torch.isnan(out[1]).all() and (out[2] == 0).all()
    with pytest.raises(ValueError, match="skinny_linear: x must be"):
        skinny_gemm.skinny_linear(torch.randn(2, 64), packed, kernel)  # float32 x, bfloat16 weight
    with pytest.raises(ValueError, match="in_features must be"):
        pack(torch.randn(8, 41).bfloat16(), None)


def test_bf16_pairs_layout_needs_its_kernel():
    """A bfloat16 pairs weight given to a build without AVX512-BF16 (the AVX2 one) is refused, not
    run through another kernel's layout."""
    avx2 = skinny_gemm.load_kernel(BUILDS["avx2"])
    if avx2 is None:
        pytest.skip("no C compiler for the skinny GEMM kernel")
    assert not avx2.bf16_dp
    packed = skinny_gemm.pack_panels_bf16_pairs(torch.randn(8, 64).bfloat16(), None)
    with pytest.raises(ValueError, match="needs the AVX512-BF16 kernel"):
        skinny_gemm.skinny_linear(torch.randn(2, 64).bfloat16(), packed, avx2)


def test_bf16_linear_uses_its_kernel_for_decode_rows_and_onednn_above(bf16_kernel, monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("needs oneDNN")
    kernel, pack = bf16_kernel
    if pack is skinny_gemm.pack_panels_bf16_pairs and kernel.amx:
        pytest.skip("Linear packs for AMX where it is granted")
    max_rows = next(m for p, m in BF16_KERNELS.values() if p is pack)
    skinny_gemm.set_enabled(None)
    torch.manual_seed(1)
    layer = Linear(64, 100, bias=True).to(torch.bfloat16)
    assert layer.pack_for_cpu(64) and layer.skinny_weight is not None and layer.packed_weight is not None
    calls = []
    original = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    w, b = layer.weight.detach(), layer.bias.detach().float()
    with torch.no_grad():
        for rows in (1, max_rows, max_rows + 1):
            x = torch.randn(rows, 64).bfloat16()
            assert_bf16_close(layer(x), x, w, b, f"{rows} rows")
    assert calls == [1, max_rows]


def test_bf16_pairs_float32_out_is_the_unrounded_sum(bf16_kernel):
    """float32_out gives the float32 sums themselves (float32 summation bound of the float64
    reference, not bfloat16's); other layouts refuse it."""
    kernel, pack = bf16_kernel
    g = torch.Generator().manual_seed(11)
    w, b = torch.randn(100, 96, generator=g).bfloat16(), torch.randn(100, generator=g)
    packed = pack(w, b)
    x = torch.randn(21, 96, generator=g).bfloat16()
    if not skinny_gemm.supports_float32_out(packed):
        with pytest.raises(ValueError, match="float32_out needs a bfloat16 pairs weight"):
            skinny_gemm.skinny_linear(x, packed, kernel, float32_out=True)
        return
    out = skinny_gemm.skinny_linear(x, packed, kernel, float32_out=True)
    assert out.dtype == torch.float32 and out.shape == (21, 100)
    err = (out.double() - reference(x, w, b)).abs().max().item()
    assert err <= tolerance(x, w) + 4 * torch.finfo(torch.float32).eps * b.abs().max().item()
    assert (out.bfloat16().float() != out).any()  # not rounded to bfloat16
    rounded = skinny_gemm.skinny_linear(x, packed, kernel)
    assert torch.equal(out.bfloat16(), rounded)  # the bfloat16 result is this sum rounded once


def test_bf16_lm_head_logits_are_float32_sums_on_the_pairs_kernel(kernel_on):
    """A bfloat16 LMHead whose skinny weight is the AVX512-BF16 one returns the unrounded float32
    logits; elsewhere the bfloat16 logits widened."""
    from pagedllm.models.layers.embedding import LMHead

    torch.manual_seed(2)
    head = LMHead(64, 300).to(torch.bfloat16)
    head.pack_for_cpu(64)
    x = torch.randn(5, 64).bfloat16()
    with torch.no_grad():
        logits = head(x)
    assert logits.dtype == torch.float32
    pairs = head.skinny_weight is not None and skinny_gemm.supports_float32_out(head.skinny_weight)
    assert (logits.bfloat16().float() != logits).any() == pairs
    err = (logits.double() - reference(x, head.weight.detach(), None)).abs().max().item()
    assert err <= (tolerance(x, head.weight.detach()) if pairs else 2.0 ** -7 * logits.abs().max().item())
