"""The Triton grouped LoRA matmul against float64 per-row math, under the interpreter on CPU: segments of
several slots, a slot in two runs, base-model rows (untouched), ranks below the slot's width."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET=1 must be set before triton kernels are imported (tests/conftest.py does)",
                allow_module_level=True)

from pagedllm.lora.layer import LoRABatch, LoRASegments, sgmv_add_torch  # noqa: E402
from pagedllm.lora.triton_sgmv import sgmv_add  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _segments(token_slots: np.ndarray) -> LoRASegments:
    batch = LoRABatch()
    batch.set(token_slots, torch.device(DEVICE), use_segments=True)
    return batch.segments


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgmv_matches_per_row_reference(dtype):
    g = torch.Generator().manual_seed(0)
    num_slots, in_features, rank, out_features = 3, 40, 24, 70  # none a tile multiple
    token_slots = np.array([0] * 5 + [-1] * 3 + [2] * 19 + [0] * 2 + [-1] + [1])
    x = torch.randn(len(token_slots), in_features, generator=g).to(dtype)
    a_t = torch.randn(num_slots, in_features, rank, generator=g).to(dtype)
    b_t = torch.randn(num_slots, rank, out_features, generator=g).to(dtype)
    base = torch.randn(len(token_slots), out_features, generator=g).to(dtype)
    segments = _segments(token_slots)
    out = sgmv_add(x.to(DEVICE), base.clone().to(DEVICE), a_t.to(DEVICE), b_t.to(DEVICE), segments).cpu()
    expected = base.double().clone()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            expected[t] += (x[t].double() @ a_t[slot].double()) @ b_t[slot].double()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    base_rows = torch.from_numpy(token_slots < 0)
    assert torch.equal(out[base_rows], base[base_rows])  # base-model rows untouched


def test_torch_grouped_matmul_matches_per_row_reference():
    g = torch.Generator().manual_seed(1)
    token_slots = np.array([1, 1, -1, 0, 0, 0, 1, -1])
    x = torch.randn(8, 16, generator=g, dtype=torch.float64)
    a_t, b_t = torch.randn(2, 16, 4, generator=g, dtype=torch.float64), torch.randn(2, 4, 12, generator=g,
                                                                                    dtype=torch.float64)
    batch = LoRABatch()
    batch.set(token_slots, torch.device("cpu"))
    assert [(s, r if isinstance(r, slice) else r.tolist()) for s, r in batch.groups] == [(0, slice(3, 6)),
                                                                                        (1, [0, 1, 6])]
    out = sgmv_add_torch(x, torch.zeros(8, 12, dtype=torch.float64), a_t, b_t, batch.groups)
    expected = torch.stack([x[t] @ a_t[s] @ b_t[s] if s >= 0 else torch.zeros(12, dtype=torch.float64)
                            for t, s in enumerate(token_slots)])
    torch.testing.assert_close(out, expected)

