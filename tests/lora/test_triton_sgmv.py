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

from pagedllm.lora.layer import LoRABatch, LoRASegments  # noqa: E402
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


@pytest.mark.parametrize("path", ["batched", "slot_by_slot", "triton"])
def test_lora_layer_paths_match_per_row_reference(path, monkeypatch):
    """A fused two-slice projection: the torch batched (padded) path, slot by slot (one run, and a slot
    in two runs), and the Triton kernels on its slices."""
    from pagedllm.lora.adapter import LoRAModuleWeights
    from pagedllm.lora.layer import LoRALayer
    from pagedllm.models.layers.linear import MergedLinear

    monkeypatch.setattr(LoRABatch, "MIN_GROUPS_BATCHED", 1 if path == "batched" else 99)
    g = torch.Generator().manual_seed(1)
    base = MergedLinear(16, [12, 20]).double().to(DEVICE)
    batch = LoRABatch()
    layer = LoRALayer(base, num_slots=3, max_rank=4, batch=batch, dtype=torch.float64, device=torch.device(DEVICE))
    weights = {}
    for slot, rank in ((0, 4), (1, 2), (2, 3)):
        a = torch.randn(rank, 16, generator=g, dtype=torch.float64)
        b0, b1 = (torch.randn(n, rank, generator=g, dtype=torch.float64) for n in (12, 20))
        parts = {0: LoRAModuleWeights(a, b0), 1: LoRAModuleWeights(a * 2, b1)} if slot != 2 else \
            {None: LoRAModuleWeights(a, torch.cat([b0, b1]))}  # slot 2: one adapter over the fused projection
        layer.set_slot(slot, {k: LoRAModuleWeights(w.lora_a.to(DEVICE), w.lora_b.to(DEVICE)) for k, w in parts.items()})
        weights[slot] = torch.cat([b0 @ a, b1 @ (a * (2 if slot != 2 else 1))])  # the dense delta (32, 16)
    token_slots = np.array([1, 1, -1, 0, 0, 0, 1, -1, 2, 2])
    batch.set(token_slots, torch.device(DEVICE), use_segments=path == "triton")
    assert (batch.padded is not None) == (path == "batched")
    x = torch.randn(10, 16, generator=g, dtype=torch.float64)
    out = layer.apply(x.to(DEVICE), torch.zeros(10, 32, dtype=torch.float64, device=DEVICE)).cpu()
    expected = torch.stack([x[t] @ weights[s].t() if s >= 0 else torch.zeros(32, dtype=torch.float64)
                            for t, s in enumerate(token_slots)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # Triton accumulates in float32
