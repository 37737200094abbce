"""The W8A8 linear by row count: the C kernel (native/int8_gemm.c, each ISA the CPU runs) with activation
groups of ``w8a8.ACTIVATION_GROUP`` features (``c_<isa>``) and with one scale per row (``c_<isa>_per_token``),
against oneDNN's int8 matmul (``int_mm_per_token``: torch._int_mm, which takes one activation scale per row
only) and the float32 linear the engine runs otherwise (skinny GEMM up to its rows, oneDNN's packed copy
above), on SmolLM2-135M's projection shapes. Interleaved rounds, median per cell.

    .venv/bin/python benchmarks/int8_gemm.py [--rows 1 4 16 64 256 1024] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import pagedllm  # noqa: F401  before torch (OpenMP wait policy)
import torch

from common import RESULTS_DIR, write_result
from pagedllm.ops import int8_gemm, skinny_gemm
from pagedllm.quantization.int8 import quantize_per_channel
from pagedllm.quantization.w8a8 import ACTIVATION_GROUP, quantize_activations

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "o": (576, 576)}


def float32_linear(w: torch.Tensor, b: torch.Tensor):
    sk = skinny_gemm.pack(w, b)
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, 64)

    def run(x):
        if sk is not None and x.shape[0] <= skinny_gemm.MAX_ROWS:
            return skinny_gemm.skinny_linear(x, sk)
        return torch.ops.mkldnn._linear_pointwise(x, onednn, b, "none", [], "")
    return run


def int_mm_per_token(x: torch.Tensor, q_kn: torch.Tensor, scales: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token W8A8 on oneDNN: int32 sums of the whole row, one rescale."""
    xq, sx = quantize_activations(x, None)
    return torch._int_mm(xq, q_kn).float().mul_(sx * scales.unsqueeze(0)).add_(b)


def time_us(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(RESULTS_DIR / "int8_gemm.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kernel = int8_gemm.load_kernel()
    isas = [name for name, code in int8_gemm.ISAS.items() if code <= kernel.best_isa and name != "scalar"]
    results: dict = {}
    for shape, (n, k) in SHAPES.items():
        w, b = torch.randn(n, k) * 0.05, torch.randn(n)
        q, scales = quantize_per_channel(w)
        packed = int8_gemm.pack(q, scales, b, ACTIVATION_GROUP)
        per_token = int8_gemm.pack(q, scales, b)
        q_kn, f32 = q.t().contiguous(), float32_linear(w, b)
        for m in args.rows:
            x = torch.randn(m, k)
            fns = {}
            for isa in isas:
                c = int8_gemm.ISAS[isa]
                fns[f"c_{isa}"] = lambda x=x, c=c: int8_gemm.int8_linear(x, packed, kernel, c)
                fns[f"c_{isa}_per_token"] = lambda x=x, c=c: int8_gemm.int8_linear(x, per_token, kernel, c)
            fns["int_mm_per_token"] = lambda x=x: int_mm_per_token(x, q_kn, scales, b)
            fns["float32"] = lambda x=x: f32(x)
            samples = {name: [] for name in fns}
            for fn in fns.values():
                fn()
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    samples[name].append(time_us(fn, args.reps))
            med = {name: statistics.median(v) for name, v in samples.items()}
            results.setdefault(shape, {})[str(m)] = med
            print(f"{shape:>8} {n}x{k} rows {m:4d}: " + " ".join(f"{k_}={v:.0f}us" for k_, v in med.items())
                  + f"  c/int_mm {med['int_mm_per_token'] / med[f'c_{isas[-1]}']:.2f}x  c/f32 {med['float32'] / med[f'c_{isas[-1]}']:.2f}x",
                  flush=True)
    out = write_result("int8_gemm", {"shapes": {s: list(v) for s, v in SHAPES.items()}, "rows": args.rows,
                                     "rounds": args.rounds, "reps": args.reps, "median_us": results}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
