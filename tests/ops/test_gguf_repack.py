"""The repacked GGUF GEMM (``native/gguf_repack.c``) against gguf's own dequantization and the documented activation
rule in float64, per block type: values, products at every row-tile size, padded tiles, bias, batch invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from pagedllm.ops import gguf_dot, gguf_repack
from tests.gguf_blocks import TYPES, quantized_reference, random_blocks

pytestmark = pytest.mark.skipif(not gguf_repack.available(), reason="the repacked GEMM needs AVX512-VNNI")


def _weight(kind, n: int, k: int, seed: int):
    raw = random_blocks(kind, n, k, np.random.default_rng(seed))
    return raw, gguf_repack.repack(int(kind), torch.from_numpy(raw), k), dequantize(raw, kind).reshape(n, k)


def _reference(x: torch.Tensor, w: np.ndarray) -> np.ndarray:
    """x quantized by the documented rule, times w, in float64."""
    q, d, _ = quantized_reference(x.numpy())
    m, k = x.shape
    return (q.reshape(m, -1, 32) * d[..., None].astype(np.float64)).reshape(m, k) @ w.astype(np.float64).T


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_values_are_gguf_dequantized_values(kind):
    """scale * code + min gives gguf's float32 values bit for bit (50 outputs: a padded last tile), bfloat16 those
    values rounded to nearest even."""
    k = 512
    _, w, ref = _weight(kind, 50, k, 0)
    assert (w.bits, w.sub) == ((4, 32) if kind in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else (8, 16 if kind == Q.Q6_K else 32))
    # the legacy types' scales and mins are halves exactly (the file's own, or an offset times one)
    assert w.scale.dtype == w.min.dtype == (torch.float32 if kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else torch.float16)
    assert np.array_equal(gguf_repack.values(w).numpy(), ref)
    bf16 = gguf_repack.values(w, out=torch.empty(50, k, dtype=torch.bfloat16))
    assert torch.equal(bf16, torch.from_numpy(ref).to(torch.bfloat16))


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 13, 40])
@pytest.mark.parametrize("n", [50, 40])
def test_products_match_the_float64_reference(kind, m, n):
    """Every register block (4 rows and their tails; one tile below 8 rows, pairs of tiles from 8, 40 outputs leaving
    a single tile), padded tiles, with a bias; the same products as the block dot product on the file's own
    blocks."""
    k = 512
    raw, w, wf = _weight(kind, n, k, 1)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    rows = gguf_dot.quantize_rows(x)
    out = torch.full((m, n), float("nan"))
    gguf_repack.dot(w, rows, out, bias)
    ref = _reference(x, wf) + bias.double().numpy()
    assert np.abs(out.double().numpy() - ref).max() <= 1e-5 * np.abs(ref).max()
    blocks = torch.empty(m, n)
    gguf_dot.dot_rows(int(kind), torch.from_numpy(raw), rows, blocks, bias)
    assert torch.allclose(out, blocks, rtol=0, atol=1e-5 * blocks.abs().max().item())


def test_rows_are_batch_and_thread_invariant(monkeypatch):
    """A row's outputs are the same bits whatever rows share the call and however many threads run it."""
    k = 768
    _, w, _ = _weight(Q.Q4_1, 96, k, 2)
    x = torch.randn(45, k)
    full = torch.empty(45, 96)
    gguf_repack.dot(w, gguf_dot.quantize_rows(x), full)
    for lo, hi in ((44, 45), (0, 1), (3, 10), (7, 45)):
        part = torch.empty(hi - lo, 96)
        gguf_repack.dot(w, gguf_dot.quantize_rows(x[lo:hi].contiguous()), part)
        assert torch.equal(part, full[lo:hi])
    monkeypatch.setattr(gguf_dot, "num_threads", lambda work: 1)
    one = torch.empty(45, 96)
    gguf_repack.dot(w, gguf_dot.quantize_rows(x), one)
    assert torch.equal(one, full)


def test_output_column_slice_and_bad_shapes():
    """out may be a column slice of a wider output (fused layers); a mismatched x or out is a ValueError."""
    k = 256
    _, w, wf = _weight(Q.Q8_0, 32, k, 3)
    x = torch.randn(3, k)
    wide = torch.zeros(3, 80)
    gguf_repack.dot(w, gguf_dot.quantize_rows(x), wide[:, 16:48])
    ref = _reference(x, wf)
    assert np.abs(wide[:, 16:48].double().numpy() - ref).max() <= 1e-5 * np.abs(ref).max()
    assert not wide[:, :16].any() and not wide[:, 48:].any()
    with pytest.raises(ValueError, match="do not fit"):
        gguf_repack.dot(w, gguf_dot.quantize_rows(torch.randn(3, 2 * k)), torch.empty(3, 32))
    with pytest.raises(ValueError, match="do not fit"):
        gguf_repack.dot(w, gguf_dot.quantize_rows(x), torch.empty(3, 31))
    with pytest.raises(ValueError, match="multiple of 256"):
        gguf_repack.repack(int(Q.Q4_K), torch.zeros(4, 144, dtype=torch.uint8), 288)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 256, 768])
def test_codes_with_group_scales(bits, group):
    """repack_codes: one scale and min per ``group`` k (768 = K: per channel) give scale * code + min and the
    float64 product of those values at every row-tile size, 40 outputs (a padded tile)."""
    n, k = 40, 768
    g = torch.Generator().manual_seed(group + bits)
    codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3
    low = -scale * (2 ** (bits - 1)) + torch.randn(n, k // group, generator=g) * 1e-3
    w = gguf_repack.repack_codes(codes, scale, low, bits, group)
    assert (w.bits, w.sub, w.group) == (bits, 32, group)
    ref = codes.double() * scale.double().repeat_interleave(group, 1) + low.double().repeat_interleave(group, 1)
    assert (gguf_repack.values(w).double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    for m in (1, 6, 11):
        x = torch.randn(m, k, generator=g)
        out = torch.empty(m, n)
        gguf_repack.dot(w, gguf_dot.quantize_rows(x), out)
        want = _reference(x, ref.numpy())
        assert np.abs(out.double().numpy() - want).max() <= 1e-5 * np.abs(want).max()


def test_codes_outside_the_layout_are_refused():
    codes = torch.zeros(4, 96, dtype=torch.uint8)
    scale = torch.ones(4, 3)
    with pytest.raises(ValueError, match="groups of 48"):
        gguf_repack.repack_codes(codes, torch.ones(4, 2), torch.ones(4, 2), 4, 48)
    with pytest.raises(ValueError, match="do not fit"):
        gguf_repack.repack_codes(codes, torch.ones(4, 2), scale, 4, 32)
    with pytest.raises(ValueError, match="above 15"):
        gguf_repack.repack_codes(codes + 16, scale, scale, 4, 32)


def test_concat_rows_joins_whole_tiles_of_one_layout():
    """Parts of one layout join when every part but the last fills its tiles; the joined product is the parts'
    products bit for bit (a fused layer's q/k/v in one call)."""
    k = 256
    _, a, wa = _weight(Q.Q4_1, 48, k, 4)
    _, b, wb = _weight(Q.Q4_1, 20, k, 5)
    _, c, _ = _weight(Q.Q8_0, 32, k, 6)
    joined = gguf_repack.concat_rows([a, b])
    assert len(joined) == 1 and joined[0].out_features == 68
    assert np.array_equal(gguf_repack.values(joined[0]).numpy(), np.concatenate([wa, wb]))
    x = gguf_dot.quantize_rows(torch.randn(7, k))
    parts = torch.empty(7, 68)
    gguf_repack.dot(a, x, parts[:, :48])
    gguf_repack.dot(b, x, parts[:, 48:])
    out = torch.empty(7, 68)
    gguf_repack.dot(joined[0], x, out)
    assert torch.equal(out, parts)
    assert [w.out_features for w in gguf_repack.concat_rows([b, a])] == [20, 48]  # b leaves its tile half empty
    assert [w.out_features for w in gguf_repack.concat_rows([a, c, a])] == [48, 32, 48]  # 4-bit, 8-bit, 4-bit
