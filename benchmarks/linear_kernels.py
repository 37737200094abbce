"""SmolLM2's linear layers on every CPU matmul path torch offers, weights streamed as in the model.

For each dtype and token count M (decode batches 1-64, prefill chunks 256-2048), one
"sweep" runs the model's projections in order — 30 layers x (fused q/k/v 576 -> 960,
o 576 -> 576, fused gate/up 576 -> 3072, down 1536 -> 576), every layer its own weights
(so they stream from memory as they do in a decode step, not from cache) — then the tied
lm_head (576 -> 49,152) on its own. Candidates:

- ``F.linear``: the plain weight (MKL sgemm in float32, oneDNN in bfloat16, packing the
  weight inside every call);
- ``onednn_b64``: the weight reordered once by ``torch.ops.mkldnn._reorder_linear_weight``
  with batch hint 64, run by ``torch.ops.mkldnn._linear_pointwise`` (the engine's path before
  this benchmark); ``onednn_bM``: the same reordered for exactly M rows;
- ``mkl_bM`` (float32): ``torch.ops.mkl._mkl_reorder_linear_weight`` for M rows,
  ``torch.ops.mkl._mkl_linear`` (MKL's packed sgemm: only for exactly M rows, any other M
  falls back to ``F.linear`` inside the op);
- ``onednn_b64_bf16_fpmath`` (float32): ``onednn_b64`` with oneDNN allowed to compute the
  float32 matmul in bfloat16 (inputs rounded, float32 accumulation and output), which is what
  ``torch.set_float32_matmul_precision("medium")`` turns on: not float32's numerics (opt-in).

Candidates of one (dtype, M) alternate within each round (a shared machine: compare ratios,
not absolute figures); medians and minimum of the rounds are reported, with GFLOP/s, and each
candidate's output is compared with ``onednn_b64``'s on the same input (max |difference|, and
whether it is bit-identical: float32 greedy outputs must not change). ``first_call_ms``: the first
``onednn_b64`` call at a new M, which builds (JIT-compiles) a oneDNN primitive for that shape;
later calls hit oneDNN's primitive cache. Writes benchmarks/results/linear_kernels_<date>.json.

    .venv/bin/python benchmarks/linear_kernels.py [--dtypes float32 bfloat16] [--tokens 1 8 32 64 256 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import common

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 576, 1536, 49152, 30
# (in_features, out_features) of one decoder layer's projections, in the order they run
LAYER_SHAPES = {"qkv": (HIDDEN, 960), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 2 * INTERMEDIATE),
                "down": (INTERMEDIATE, HIDDEN)}


def candidates(weights: list[torch.Tensor], dtype: torch.dtype, m: int) -> dict:
    """name -> function(i, x) computing x @ weights[i].T on that candidate's path."""
    def onednn(hint):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in weights]
        return lambda i, x: torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")

    out = {"F.linear": lambda i, x: F.linear(x, weights[i]), "onednn_b64": onednn(64)}
    if m != 64:
        out["onednn_bM"] = onednn(m)
    if dtype == torch.float32:
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights]
        out["mkl_bM"] = lambda i, x: torch.ops.mkl._mkl_linear(x, mkl[i], weights[i], None, m)
        out["onednn_b64_bf16_fpmath"] = bf16_fpmath(out["onednn_b64"])
    return out


def bf16_fpmath(fn):
    """``fn`` run with oneDNN's float32 math allowed to round inputs to bfloat16 (AMX), what
    ``torch.set_float32_matmul_precision("medium")`` selects on CPU."""
    def run(i, x):
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        try:
            return fn(i, x)
        finally:
            torch.backends.mkldnn.matmul.fp32_precision = "none"
    return run


def time_sweeps(cands: dict, inputs: list[torch.Tensor], rounds: int, clock) -> dict[str, list[float]]:
    """Seconds per sweep (every weight once, in order), candidates alternating each round."""
    times: dict[str, list[float]] = {name: [] for name in cands}
    for name, fn in cands.items():  # warm-up: primitive creation, first touch of packed copies
        for i, x in enumerate(inputs):
            fn(i, x)
    for _ in range(rounds):
        for name, fn in cands.items():
            t = clock()
            for i, x in enumerate(inputs):
                fn(i, x)
            times[name].append(clock() - t)
    return times


def compare(cands: dict, inputs: list[torch.Tensor]) -> dict[str, dict]:
    """Each candidate's outputs against onednn_b64's: max |diff| and bit-identity over all weights."""
    ref = [cands["onednn_b64"](i, x) for i, x in enumerate(inputs)]
    out = {}
    for name, fn in cands.items():
        diffs = [(fn(i, x).float() - r.float()).abs().max().item() for (i, x), r in zip(enumerate(inputs), ref)]
        out[name] = {"max_abs_diff": max(diffs), "identical": all(d == 0 for d in diffs)}
    return out


def first_call_ms(weight: torch.Tensor, m: int, dtype: torch.dtype) -> float:
    """Wall ms of the first oneDNN call at M rows for a freshly packed weight (no cached primitive
    for this M when M was never run before in the process)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    x = torch.randn(m, weight.shape[1], dtype=dtype)
    t = time.perf_counter()
    torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return (time.perf_counter() - t) * 1e3


def run_case(weights, shapes, dtype, m, rounds, gen, clock) -> dict:
    inputs = [torch.randn(m, k, generator=gen).to(dtype) for k, _ in shapes]
    cands = candidates(weights, dtype, m)
    times = time_sweeps(cands, inputs, rounds, clock)
    flop = sum(2 * m * k * n for k, n in shapes)
    acc = compare(cands, inputs)
    res = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        res[name] = {"median_ms": med * 1e3, "min_ms": min(ts) * 1e3, "gflops_median": flop / med / 1e9, **acc[name]}
    base = res["onednn_b64"]["median_ms"]
    for r in res.values():
        r["speedup_vs_onednn_b64"] = base / r["median_ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 16, 32, 48, 64, 256, 2048])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prefill-layers", type=int, default=3,
                    help="layers per sweep for M >= 256 (compute-bound: fewer layers keep the run short)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: one torch thread, thread CPU time (holds on a loaded machine; wall does not)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    clock = time.perf_counter
    if args.clock == "cpu":
        torch.set_num_threads(1)
        clock = time.thread_time
    gen = torch.Generator().manual_seed(0)
    record = {"threads": torch.get_num_threads(), "clock": args.clock, "layers": LAYERS, "results": {}}
    lines = []
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        layer_ws = [torch.randn(n, k, generator=gen).mul_(k ** -0.5).to(dtype)
                    for _ in range(LAYERS) for k, n in LAYER_SHAPES.values()]
        head_w = [torch.randn(VOCAB, HIDDEN, generator=gen).mul_(HIDDEN ** -0.5).to(dtype)]
        first = {m: first_call_ms(layer_ws[2], m, dtype) for m in (37, 61, 1999)}  # Ms used nowhere else
        per_m = {}
        for m in args.tokens:
            n_layers = LAYERS if m < 256 else args.prefill_layers
            layers = run_case(layer_ws[:4 * n_layers], list(LAYER_SHAPES.values()) * n_layers, dtype, m,
                              args.rounds, gen, clock)
            head = run_case(head_w, [(HIDDEN, VOCAB)], dtype, m, args.rounds, gen, clock)
            per_m[m] = {"layers_per_sweep": n_layers, "layers": layers, "lm_head": head}
            best = min(layers, key=lambda k: layers[k]["median_ms"])
            best_h = min(head, key=lambda k: head[k]["median_ms"])
            lines.append(f"{dname} M={m}: layers " + ", ".join(f"{k} {v['median_ms']:.2f}" for k, v in layers.items())
                         + f" ms (best {best}); lm_head " + ", ".join(f"{k} {v['median_ms']:.2f}" for k, v in head.items())
                         + f" ms (best {best_h})")
            print(lines[-1], flush=True)
        record["results"][dname] = {"first_call_ms_new_M_gate_up": first, "per_tokens": per_m}
    date = time.strftime("%Y-%m-%d")
    path = common.write_result(f"linear_kernels_{date}", record, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
