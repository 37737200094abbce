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
later calls hit oneDNN's primitive cache; ``rss_mib_per_new_M_gate_up``: the memory each new M
keeps in those caches. Writes benchmarks/results/linear_kernels_<date>.json.

``--in-model`` measures instead the real float32 model (SmolLM2) in the engine, float32 math
against the opt-in bfloat16 math (``Linear.bf16_math``, ``PAGEDLLM_CPU_FP32_MATMUL=bf16``),
switched on the live engine and alternating: decode steps at ``--batch`` (context ~160) and
whole 2,048-token prefills (one request, one chunk), each timed in wall and CPU time, of the
linear layers and of the whole step, with ``--threads`` torch threads (default 1: CPU time is
then exact and holds on a loaded machine, where two threads waiting on each other at every
OpenMP barrier are not). Writes benchmarks/results/linear_kernels_in_model_<date>.json.

    .venv/bin/python benchmarks/linear_kernels.py [--dtypes float32 bfloat16] [--tokens 1 8 32 64 256 2048]
    .venv/bin/python benchmarks/linear_kernels.py --in-model [--batch 32 --rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
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


def new_row_count_memory_mib(dtype: torch.dtype, counts: range = range(300, 400)) -> float:
    """Resident memory (MiB) that each new row count adds, for the fused gate/up weight: oneDNN's
    primitive cache and ideep's cache keep one entry per (shape, M) (1,024 each by default).
    glibc is told to map every allocation over 64 KiB on its own, so freed outputs do not
    count (``mallopt(M_MMAP_THRESHOLD)``, Linux only; NaN elsewhere)."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        page = os.sysconf("SC_PAGE_SIZE")
    except (OSError, AttributeError, ValueError):
        return float("nan")

    def rss() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page / 2**20

    w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(2 * INTERMEDIATE, HIDDEN).to(dtype), 64)
    xs = [torch.randn(m, HIDDEN).to(dtype) for m in counts]
    torch.ops.mkldnn._linear_pointwise(xs[0][:7], w, None, "none", [], "")
    before = rss()
    for x in xs:
        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return (rss() - before) / len(xs)


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


def in_model(batch: int, rounds: int, steps: int, threads: int) -> dict:
    """Decode steps and 2,048-token prefills of the float32 engine, float32 vs bfloat16 math in
    its linears, alternating; medians over rounds (ms) of wall and CPU time, the linears' and
    the whole step's, with ``threads`` torch threads (CPU time is the main thread's: exact with 1)."""
    import random

    from pagedllm import LLM, SamplingParams
    from pagedllm.models.layers.linear import Linear
    from pagedllm.ops import skinny_gemm

    # Both modes on oneDNN's packed weight (the bf16 math is a oneDNN setting), so the skinny
    # GEMM, which would take the float32 decode rows, stays off here.
    skinny_gemm.set_enabled(False)
    llm = LLM(dtype="float32", max_model_len=4096, kv_cache_memory="2GiB", max_num_seqs=batch + 1,
              max_num_batched_tokens=2048)
    eng = llm.llm_engine
    linears = [m for m in eng.runner.model.modules() if isinstance(m, Linear) and m.packed_weight is not None]
    rng = random.Random(0)
    decode = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(None, [rng.randrange(17, 49000) for _ in range(160)], decode)
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
    eng.step()
    linear_cpu = [0.0]
    forward = Linear.forward

    def timed_forward(self, x):
        t = time.thread_time()
        try:
            return forward(self, x)
        finally:
            linear_cpu[0] += time.thread_time() - t

    def decode_steps(n: int) -> tuple[float, float, float]:
        linear_cpu[0] = 0.0
        w, c = time.perf_counter(), time.thread_time()
        for _ in range(n):
            eng.step()
        return (time.perf_counter() - w) / n, (time.thread_time() - c) / n, linear_cpu[0] / n

    def prefill() -> tuple[float, float, float]:
        """One step of 2,048 tokens: a new prompt of 2,048 - batch tokens plus the batch's
        decode rows."""
        req = eng.add_request(None, [rng.randrange(17, 49000) for _ in range(2048 - batch)],
                              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        linear_cpu[0] = 0.0
        w, c = time.perf_counter(), time.thread_time()
        eng.step()  # one chunk: the prompt + the batch's decode rows = 2,048 tokens
        out = time.perf_counter() - w, time.thread_time() - c, linear_cpu[0]
        if req in eng.output_processor.requests:
            raise RuntimeError("the 2,048-token prompt was not prefilled in one step (a prefill cap?)")
        return out

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    res: dict[str, dict[str, list[float]]] = {}
    Linear.forward = timed_forward
    try:
        for _ in range(rounds):
            for mode in ("fp32_math", "bf16_math"):
                for m in linears:
                    m.bf16_math = mode == "bf16_math"
                r = res.setdefault(mode, {})
                for key, val in zip(("decode_wall", "decode_cpu", "decode_linear_cpu"), decode_steps(steps)):
                    r.setdefault(key, []).append(val * 1e3)
                for key, val in zip(("prefill_wall", "prefill_cpu", "prefill_linear_cpu"), prefill()):
                    r.setdefault(key, []).append(val * 1e3)
    finally:
        Linear.forward = forward
        torch.set_num_threads(saved_threads)
        for m in linears:
            m.bf16_math = False
    med = {mode: {k: statistics.median(v) for k, v in r.items()} for mode, r in res.items()}
    ratio = {k: med["fp32_math"][k] / med["bf16_math"][k] for k in med["fp32_math"]}
    return {"batch": batch, "threads": threads, "cpu_time": "main thread (all of it with one thread)",
            "rounds": rounds, "decode_steps_per_round": steps, "prefill_tokens": 2048,
            "median_ms": med, "speedup_bf16_math": ratio, "samples_ms": res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 16, 32, 48, 64, 256, 2048])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prefill-layers", type=int, default=3,
                    help="layers per sweep for M >= 256 (compute-bound: fewer layers keep the run short)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: one torch thread, thread CPU time (holds on a loaded machine; wall does not)")
    ap.add_argument("--in-model", action="store_true", help="the float32 engine, float32 vs bfloat16 math")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4, help="--in-model: decode steps per round and mode")
    ap.add_argument("--threads", type=int, default=1,
                    help="--in-model: torch threads (1: CPU time is exact and holds on a loaded machine)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.in_model:
        rec = in_model(args.batch, args.rounds, args.steps, args.threads)
        path = common.write_result(f"linear_kernels_in_model_{time.strftime('%Y-%m-%d')}", rec, args.out)
        m, r = rec["median_ms"], rec["speedup_bf16_math"]
        print("float32 engine, float32 -> bfloat16 math in the linears (median ms): "
              + "; ".join(f"{k} {m['fp32_math'][k]:.1f} -> {m['bf16_math'][k]:.1f} ({r[k]:.2f}x)" for k in r)
              + f"; wrote {path}")
        return
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
        memory = new_row_count_memory_mib(dtype)
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
        record["results"][dname] = {"first_call_ms_new_M_gate_up": first,
                                    "rss_mib_per_new_M_gate_up": memory, "per_tokens": per_m}
    date = time.strftime("%Y-%m-%d")
    path = common.write_result(f"linear_kernels_{date}", record, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
