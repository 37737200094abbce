"""GGUF block dot products (pagedllm/native/gguf_dot.c) against gguf's own dequantization, then a float64 matmul
with the activations quantized by the kernel's documented rule (per 32: d = max|x| / 127, q = round(x / d)).

Every path this CPU runs is tested (portable C, AVX2, AVX512-VNNI), in the native build and an ``-march=haswell``
build (what an AVX2-only host compiles); a path the CPU cannot execute is skipped with the reason. Batch and
thread invariance are checked bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize

from pagedllm.envs import GGUF_DOT_ISA
from pagedllm.ops import gguf_dot
from tests.gguf_blocks import TYPES, quantized_reference, random_blocks

BUILDS = {"native": (), "avx2": ("-march=haswell",)}
PATHS = {"scalar": 0, "avx2": 1, "avx512": 2}


@pytest.fixture(scope="module", params=list(BUILDS))
def kernel(request):
    k = gguf_dot.load_kernel(BUILDS[request.param])
    if k is None:
        pytest.skip("no C compiler for the GGUF dot-product kernel")
    return k


def reference(raw: np.ndarray, kind, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float64 out, a bound on float32 accumulation error per output)."""
    n = raw.shape[0]
    w = dequantize(raw, kind).reshape(n, -1).astype(np.float64)
    q, d, _ = quantized_reference(x)
    xq = (q.reshape(q.shape[0], -1, 32).astype(np.float64) * d[..., None]).reshape(q.shape)
    return xq @ w.T, 2e-6 * (np.abs(xq) @ np.abs(w).T) + 1e-30


def run(k, kind, raw: np.ndarray, x: torch.Tensor, path: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(x.shape[0], raw.shape[0])
    gguf_dot.dot_rows(int(kind), torch.from_numpy(raw), gguf_dot.quantize_rows(x, k), out, bias, k, path)
    return out


def _path(k, name: str) -> int:
    if not k.isa_available(PATHS[name]):
        pytest.skip(f"this CPU cannot run the {name} path")
    return PATHS[name]


@pytest.mark.parametrize("path", list(PATHS))
def test_activation_quantization_follows_the_documented_rule(kernel, path):
    """Every path (portable C and the SIMD body) writes the documented rule's bits, ties to even included."""
    path_id = _path(kernel, path)
    x = torch.randn(7, 640) * torch.logspace(-3, 2, 640)
    x[2, :32] = 0.0  # an all-zero block: d = 0, q = 0
    x[3, 32:64] = torch.arange(-16, 16) + 0.5  # d = 1 (the block's max is 127): every other product a tie at .5
    x[3, 32] = 127.0
    rows = gguf_dot.quantize_rows(x, kernel, path_id)
    q, d, s = quantized_reference(x.numpy())
    assert np.array_equal(rows.q.numpy(), q) and np.array_equal(rows.d.numpy(), d)
    np.testing.assert_allclose(rows.s.numpy(), s, rtol=1e-6, atol=0)
    q16 = q.reshape(7, -1, 16).astype(np.int32).sum(-1).astype(np.float32) * np.repeat(d, 2, axis=1)
    np.testing.assert_allclose(rows.s16.numpy(), q16, rtol=1e-6, atol=0)
    bf16 = gguf_dot.quantize_rows(x.bfloat16(), kernel, path_id)
    assert np.array_equal(bf16.q.numpy(), quantized_reference(x.bfloat16().float().numpy())[0])


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf(kernel, kind, path):
    """Every path's unpacking gives gguf's values bit for bit (float32), and those rounded to nearest even
    (bfloat16, torch's rounding); rows of a wider buffer too."""
    path_id = _path(kernel, path)
    raw = random_blocks(kind, 9, 512, np.random.default_rng(1))
    ref = dequantize(raw, kind).reshape(9, 512).astype(np.float32)
    got = gguf_dot.dequantize_rows(int(kind), torch.from_numpy(raw), 512, k=kernel, path=path_id)
    assert np.array_equal(got.numpy(), ref)
    wide = torch.zeros(9, 544, dtype=torch.bfloat16)
    gguf_dot.dequantize_rows(int(kind), torch.from_numpy(raw), 512, out=wide[:, :512], k=kernel, path=path_id)
    assert torch.equal(wide[:, :512], torch.from_numpy(ref).bfloat16()) and not wide[:, 512:].any()


def test_dequantize_refuses_an_out_that_does_not_fit(kernel):
    raw = torch.from_numpy(random_blocks(TYPES[0], 4, 256, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="out must be float32 or bfloat16"):
        gguf_dot.dequantize_rows(int(TYPES[0]), raw, 256, out=torch.empty(4, 256, dtype=torch.float16), k=kernel)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_dot_equals_dequantize_then_matmul(kernel, kind, path):
    path_id = _path(kernel, path)
    rng = np.random.default_rng(2)
    per = GGML_QUANT_SIZES[kind][0]
    shapes = [(37, 256), (1, 768)] if per == 256 else [(37, 256), (5, 576), (3, 640)]
    for n, k in shapes:
        raw = random_blocks(kind, n, k, rng)
        x = torch.randn(6, k)
        ref, bound = reference(raw, kind, x.numpy())
        assert np.all(np.abs(run(kernel, kind, raw, x, path_id).numpy() - ref) <= bound)
    bias = torch.randn(n)
    with_bias = run(kernel, kind, raw, x, path_id, bias).numpy()
    assert np.all(np.abs(with_bias - (ref + bias.numpy()[None])) <= bound + 1e-6)


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_every_row_count_gives_the_same_rows(kernel, kind):
    """Rows 1..300: each call's rows are bitwise the rows of the 300-row call (a request's outputs do not
    depend on what it is batched with), on the path this process uses."""
    rng = np.random.default_rng(3)
    raw = random_blocks(kind, 5, 256, rng)
    x = torch.randn(300, 256)
    path = gguf_dot.isa(kernel)
    full = run(kernel, kind, raw, x, path)
    ref, bound = reference(raw, kind, x.numpy())
    assert np.all(np.abs(full.numpy() - ref) <= bound)
    for m in range(1, 300):
        assert torch.equal(run(kernel, kind, raw, x[300 - m:], path), full[300 - m:]), m


def test_thread_count_changes_no_bits(kernel):
    raw = random_blocks(Q.Q4_K, 1024, 512, np.random.default_rng(4))
    x = torch.randn(3, 512)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(kernel, Q.Q4_K, raw, x, gguf_dot.isa(kernel))
        torch.set_num_threads(max(2, threads))
        many = run(kernel, Q.Q4_K, raw, x, gguf_dot.isa(kernel))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_output_columns_of_a_wider_tensor(kernel):
    """A fused layer writes each part into its columns of one output."""
    rng = np.random.default_rng(5)
    a, b = random_blocks(Q.Q5_0, 4, 256, rng), random_blocks(Q.Q8_0, 3, 256, rng)
    x = torch.randn(2, 256)
    rows = gguf_dot.quantize_rows(x, kernel)
    out = torch.full((2, 7), float("nan"))
    gguf_dot.dot_rows(int(Q.Q5_0), torch.from_numpy(a), rows, out[:, :4], k=kernel)
    gguf_dot.dot_rows(int(Q.Q8_0), torch.from_numpy(b), rows, out[:, 4:], k=kernel)
    assert torch.equal(out[:, :4], run(kernel, Q.Q5_0, a, x, gguf_dot.isa(kernel)))
    assert torch.equal(out[:, 4:], run(kernel, Q.Q8_0, b, x, gguf_dot.isa(kernel)))


def test_path_switch(kernel, monkeypatch):
    for name, value in (("scalar", 0), ("avx2", 1), ("avx512", 2)):
        monkeypatch.setenv(GGUF_DOT_ISA.name, name)
        if kernel.isa_available(value):
            assert gguf_dot.isa(kernel) == value
        else:
            with pytest.raises(ValueError, match=GGUF_DOT_ISA.name):
                gguf_dot.isa(kernel)
    monkeypatch.setenv(GGUF_DOT_ISA.name, "auto")
    assert kernel.isa_available(gguf_dot.isa(kernel))
    monkeypatch.setenv(GGUF_DOT_ISA.name, "sse")
    with pytest.raises(ValueError, match=GGUF_DOT_ISA.name):
        gguf_dot.isa(kernel)


def test_bad_shapes_are_refused(kernel):
    rows = gguf_dot.quantize_rows(torch.randn(2, 288), kernel)
    raw = torch.from_numpy(random_blocks(Q.Q4_0, 3, 288, np.random.default_rng(6)))
    with pytest.raises(ValueError, match="no kernel"):
        gguf_dot.dot_rows(int(Q.F16), raw, rows, torch.empty(2, 3), k=kernel)
    with pytest.raises(ValueError, match="multiple of 256"):
        gguf_dot.dot_rows(int(Q.Q4_K), raw, rows, torch.empty(2, 3), k=kernel)
    with pytest.raises(ValueError, match="out must be"):
        gguf_dot.dot_rows(int(Q.Q4_0), raw, rows, torch.empty(2, 4), k=kernel)
    with pytest.raises(ValueError, match="multiple of 32"):
        gguf_dot.quantize_rows(torch.randn(2, 100), kernel)
