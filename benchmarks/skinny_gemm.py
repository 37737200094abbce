"""The skinny GEMM (pagedllm/native/skinny_gemm.c) against oneDNN and torch on a decode step's linears.

Two parts, one process, paths alternated so they see the same machine load:

1. Kernels: SmolLM2's four projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536)
   in 30 layers' worth of distinct ``--dtype`` weights (424 MB in float32, 212 MB in bfloat16:
   each weight comes from memory, as in a real step), at each ``--rows`` count: the skinny kernel
   (float32 FMA; for bfloat16 AMX, else AVX512-BF16's vdpbf16ps), oneDNN's prepacked linear (what ``Linear`` used before) and
   plain ``F.linear``. Median ms per pass over the 120 matmuls, and GFLOP/s.
2. Engine: decode steps at ``--batch`` with the model's linears packed for the skinny kernel vs
   for oneDNN only (``skinny_gemm.set_enabled`` + repacking), median wall and CPU time per step;
   and greedy agreement between the two on the peers workload's prompts (each output element is
   the same sum in another order, so tokens should agree but for near-ties; in bfloat16 a near-tie
   is a value at a rounding boundary, so a few may differ).

    .venv/bin/python benchmarks/skinny_gemm.py --rows 1,8,32,64,128,256
    .venv/bin/python benchmarks/skinny_gemm.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import common
import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch
import torch.nn.functional as F

from pagedllm.ops import skinny_gemm

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (N, K)
LAYERS = 30


def kernel_paths(rows: int, weights: list[torch.Tensor]) -> dict:
    """One pass over every weight per path, as callables: skinny, onednn_packed, torch."""
    kernel = skinny_gemm.load_kernel()
    if weights[0].dtype == torch.bfloat16:
        pack_bf16 = skinny_gemm.pack_panels_bf16 if kernel.amx else skinny_gemm.pack_panels_bf16_pairs
        skinny = [pack_bf16(w, None) for w in weights]
    else:
        skinny = [skinny_gemm.pack_panels(w, None, kernel.panel_width) for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    xs = {k: torch.randn(rows, k).to(weights[0].dtype) for k in {w.shape[1] for w in weights}}

    def run_skinny():
        for p in skinny:
            skinny_gemm.skinny_linear(xs[p.in_features], p, kernel)

    def run_onednn():
        for p, w in zip(packed, weights):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

    def run_torch():
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    return {"skinny": run_skinny, "onednn_packed": run_onednn, "torch": run_torch}


def kernel_rounds(rows_list: list[int], rounds: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) * 0.05).to(dtype) for _ in range(LAYERS) for n, k in SHAPES.values()]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    out = {}
    for rows in rows_list:
        paths = kernel_paths(rows, weights)
        times: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(rounds):
            for name, fn in paths.items():
                fn()  # warm the code paths; the weights are evicted by the other paths' passes
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        med = {p: statistics.median(v) for p, v in times.items()}
        out[rows] = {"median_ms": {p: v * 1e3 for p, v in med.items()},
                     "gflops": {p: flops_per_row * rows / v / 1e9 for p, v in med.items()},
                     "skinny_speedup_vs_onednn": med["onednn_packed"] / med["skinny"],
                     "skinny_speedup_vs_torch": med["torch"] / med["skinny"]}
        r = out[rows]
        print(f"rows {rows:4d}: skinny {r['median_ms']['skinny']:7.1f} ms, oneDNN packed "
              f"{r['median_ms']['onednn_packed']:7.1f} ms, F.linear {r['median_ms']['torch']:7.1f} ms "
              f"(skinny x{r['skinny_speedup_vs_onednn']:.2f} vs oneDNN)", flush=True)
    return out


def set_path(model, skinny: bool) -> None:
    skinny_gemm.set_enabled(skinny)
    model.pack_linears_for_cpu()


def engine_rounds(batch: int, prompt_len: int, rounds: int, steps: int, dtype: str) -> dict:
    import random

    from pagedllm import LLM, SamplingParams

    llm = LLM(dtype=dtype, max_model_len=1024, kv_cache_memory="2GiB", max_num_seqs=max(batch, 32))
    eng, model = llm.llm_engine, llm.llm_engine.runner.model
    workload = common.peers_workload()
    tokens = {}
    for path in (True, False):
        set_path(model, path)
        outs = common.generate_greedy(llm, workload.prompts, 64)
        tokens[path] = [list(o.outputs[0].token_ids) for o in outs]
    equal = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=2 * rounds * (steps + 1) + 4, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(None, [rng.randrange(common.FIRST_ORDINARY_TOKEN_ID, common.SMOLLM2_VOCAB_SIZE)
                               for _ in range(prompt_len)], params)
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
    times = {p: {"wall": [], "cpu": []} for p in ("skinny", "onednn_packed")}
    for _ in range(rounds):
        for name in times:
            set_path(model, name == "skinny")
            eng.step()  # not timed: the first step after repacking
            for _ in range(steps):
                w, c = time.perf_counter(), time.process_time()
                eng.step()
                times[name]["wall"].append(time.perf_counter() - w)
                times[name]["cpu"].append(time.process_time() - c)
    skinny_gemm.set_enabled(None)
    med = {p: {k: statistics.median(v) * 1e3 for k, v in t.items()} for p, t in times.items()}
    return {"batch": batch, "prompt_len": prompt_len, "median_step_ms": med,
            "skinny_over_onednn": {k: med["skinny"][k] / med["onednn_packed"][k] for k in ("wall", "cpu")},
            "greedy_requests_equal": f"{equal}/{len(tokens[True])}", "greedy_max_tokens": 64}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,64,128,256", help="row counts for the kernel part")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--engine-rounds", type=int, default=4, help="0: skip the engine part")
    ap.add_argument("--steps", type=int, default=5, help="decode steps per path per engine round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernel = skinny_gemm.load_kernel()
    if kernel is None:
        raise SystemExit("the skinny GEMM kernel cannot be built here (no C compiler?)")
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and not (kernel.amx or kernel.bf16_dp):
        raise SystemExit("the bfloat16 skinny GEMM needs AMX or AVX512-BF16, which this CPU or build lacks")
    record = {"dtype": args.dtype, "threads": torch.get_num_threads(), "vector_width": kernel.vector_width,
              "amx": kernel.amx, "bf16_dp": kernel.bf16_dp, "kernels": kernel_rounds([int(r) for r in args.rows.split(",")], args.rounds, dtype)}
    if args.engine_rounds:
        record["engine"] = engine_rounds(args.batch, args.prompt_len, args.engine_rounds, args.steps, args.dtype)
        e = record["engine"]
        print(f"engine decode step at batch {args.batch} ({args.dtype}): skinny {e['median_step_ms']['skinny']['wall']:.1f} ms vs "
              f"oneDNN {e['median_step_ms']['onednn_packed']['wall']:.1f} ms (wall x{e['skinny_over_onednn']['wall']:.3f}, "
              f"CPU x{e['skinny_over_onednn']['cpu']:.3f}); greedy requests equal {e['greedy_requests_equal']}")
    path = common.write_result(f"skinny_gemm_{args.dtype}", record, args.out)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
