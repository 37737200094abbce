"""Quantized linear layers with float32 activations: torch's CPU kernels against tile-wise dequantization.

SmolLM2-135M's projection shapes as the engine runs them (in -> out features: fused q/k/v
576 -> 960, o 576 -> 576, fused gate/up 576 -> 3072, down 1536 -> 576), at token counts 1-128
(a decode batch). For each weight format, every way the engine could compute ``x @ W.T`` with
float32 ``x``:

- int8 (per-channel scales):
  ``tiles`` (dequantize 16-row tiles to float32, ``torch.mm``, scales on the output),
  ``int8pack_f32`` (``aten._weight_int8pack_mm`` on float32 x: torch's generic path),
  ``int8pack_bf16`` (x rounded to bfloat16, the same kernel's bfloat16 path, back to float32),
  ``int_mm`` (x quantized per row to int8 on the fly, ``torch._int_mm``, both scales on the
  int32 result: W8A8 with dynamic activation scales);
- int4 (group 32, affine):
  ``tiles``, ``int4pack_bf16`` (x in bfloat16, ``aten._weight_int4pack_mm_for_cpu``);
- float32 (``torch.mm`` on the dense weight), the baseline.

Each candidate's result is compared with float32 ``x @ dequantize(W).T``: max |difference|
relative to max |reference|. Candidates of one shape and batch run alternately, rounds
repeat, medians are reported with the load average, ratios against float32 and against
``tiles``. Writes benchmarks/results/quantized_matmul.json.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/quantized_matmul.py [--batches 1 4 16 64 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

import common

sys.path.insert(0, str(common.REPO_ROOT))  # run from a checkout without installing

from pagedllm.quantization.base import tile_rows, tiled_linear  # noqa: E402
from pagedllm.quantization.int4 import Int4LinearMethod, pack_nibbles, quantize_groups  # noqa: E402
from pagedllm.quantization.int8 import quantize_per_channel  # noqa: E402

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def int8_candidates(w: torch.Tensor):
    q, scale = quantize_per_channel(w)
    ref_w = q.float() * scale.unsqueeze(1)
    scale_bf16 = scale.to(torch.bfloat16)
    q_t = q.t().contiguous()  # (K, N) for _int_mm

    def tiles(x):
        out = tiled_linear(x, q.shape[0], lambda s, e: q[s:e].float(), tile_rows(q.shape[1], torch.float32))
        return out.mul_(scale)

    def int8pack_f32(x):
        return torch.ops.aten._weight_int8pack_mm(x, q, scale)

    def int8pack_bf16(x):
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, scale_bf16).float()

    def int_mm(x):
        sx = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0  # (M, 1)
        xq = torch.round(x / sx).clamp_(-127, 127).to(torch.int8)
        return torch._int_mm(xq, q_t).float().mul_(sx).mul_(scale)

    return ref_w, {"tiles": tiles, "int8pack_f32": int8pack_f32, "int8pack_bf16": int8pack_bf16, "int_mm": int_mm}


def int4_candidates(w: torch.Tensor, group: int = 32):
    qv, scales, zeros = quantize_groups(w, group)
    n, k = w.shape
    ref_w = ((qv.float().view(n, k // group, group) - 8) * scales.unsqueeze(2) + zeros.unsqueeze(2)).view(n, k)
    layer = torch.nn.Module()
    layer.qweight, layer.scales, layer.zeros = pack_nibbles(qv), scales, zeros
    kernel_q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qv.to(torch.int32), 1)
    scale_zero = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()

    def tiles(x):
        return tiled_linear(x, n, lambda s, e: Int4LinearMethod._rows(layer, s, e, torch.float32),
                            tile_rows(k, torch.float32))

    def int4pack_bf16(x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), kernel_q, group, scale_zero).float()

    return ref_w, {"tiles": tiles, "int4pack_bf16": int4pack_bf16}


def median_ms(fn, x, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    results = {}
    for fmt, make in (("int8", int8_candidates), ("int4", int4_candidates)):
        for shape_name, (k, n) in SHAPES.items():
            w = torch.randn(n, k, generator=gen) * 0.05
            ref_w, cands = make(w)
            cands = {"float32": lambda x, w=ref_w: x @ w.t(), **cands}
            for m in args.batches:
                x = torch.randn(m, k, generator=gen)
                ref = x.double() @ ref_w.double().t()
                errors = {c: ((fn(x).double() - ref).abs().max() / ref.abs().max()).item() for c, fn in cands.items()}
                samples = {c: [] for c in cands}
                for _ in range(args.rounds):  # alternate: every candidate sees the same load
                    for c, fn in cands.items():
                        samples[c].append(median_ms(fn, x, args.reps))
                ms = {c: statistics.median(s) for c, s in samples.items()}
                results[f"{fmt}/{shape_name}/{m}"] = {"ms": ms, "rel_error": errors}
                best = min((c for c in cands if c != "float32"), key=ms.get)
                print(f"{fmt:4} {shape_name:7} M={m:3}: " + ", ".join(
                    f"{c} {t:.3f}ms ({ms['float32'] / t:.2f}x f32, err {errors[c]:.1e})" for c, t in ms.items())
                    + f" -> {best}", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    results = bench(args)
    record = {"config": vars(args), "threads": torch.get_num_threads(), "load_avg_before": load_before,
              "load_avg_after": os.getloadavg()[0], "results": results}
    print(f"wrote {common.write_result('quantized_matmul', record, args.out)}")


if __name__ == "__main__":
    main()
