"""KV-cache dtypes: names, storage bytes, and the quantize/dequantize round trip bounded by
each format's rounding error."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.quantization.kv_cache import dequantize_kv, quantize_kv, resolve_kv_cache_dtype


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


def test_int8_per_token_head_scales():
    x = torch.randn(50, 3, 16)
    x[7, 1] = 0.0  # an all-zero head must not divide by zero
    q, scales = quantize_kv(x, torch.int8)
    assert q.dtype == torch.int8 and scales.shape == (50, 3) and scales.dtype == torch.float32
    assert torch.allclose(scales, torch.where(x.abs().amax(-1) > 0, x.abs().amax(-1) / 127, torch.ones(())))
    back = dequantize_kv(q, scales, torch.float32)
    assert ((back - x).abs() <= scales.unsqueeze(-1) / 2 * (1 + 1e-5)).all()
    assert torch.equal(back[7, 1], torch.zeros(16))
