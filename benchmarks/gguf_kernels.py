"""GGUF blocks kept packed (``quantization="gguf"``) against the same model dequantized to float32.

``--part kernels``: one projection (2048 x 1024, random blocks of each type), rows 1..512: the repacked GEMM (AVX512-VNNI
CPUs: ``ops.gguf_repack``, what ``quantization="gguf"`` runs there), the block dot product and the dequantized
float32 panel + ``torch.mm`` (the two paths of the file's own blocks, elsewhere; activations quantized per call
included), and the float32 ``Linear`` the dequantized model runs (skinny GEMM / oneDNN), in alternating rounds;
GOP/s medians. The crossing of the dot product and the panel sets ``quantization.gguf.DOT_MAX_ROWS``.

``--part models``: output tok/s of whole models (greedy, EOS ignored), gguf vs float32, batch 1 (one prompt),
4 and 16 (64 new tokens each) and the peers' batch (32 prompts x 128 tokens, ``common.peers_workload``), rounds alternating the two engines
with fresh prompts each round. Writes benchmarks/results/gguf_kernels.json (or ``--out``).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/gguf_kernels.py [--part kernels models] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import numpy as np
import torch

import common

sys.path.insert(0, str(common.REPO_ROOT))  # run from a checkout without installing

from gguf import GGMLQuantizationType as Q  # noqa: E402

from pagedllm.models.layers.linear import Linear  # noqa: E402
from pagedllm.ops import gguf_dot, gguf_repack  # noqa: E402
from pagedllm.quantization.gguf import panel_linear  # noqa: E402
from tests.gguf_blocks import TYPES, random_blocks  # noqa: E402

SHAPE = (2048, 1024)  # out, in features
ROWS = (1, 4, 16, 32, 64, 128, 256, 512)
MODELS = {"smollm2-135m (Q4_1)": "smollm2-135m-instruct", "gemma3-270m (Q4_K_M)": "gemma3-270m"}


def _time(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def kernel_part(rounds: int, rows: list[int], types: list) -> dict:
    n, k = SHAPE
    rng = np.random.default_rng(0)
    dense = Linear(k, n, bias=False).requires_grad_(False)
    dense.pack_for_cpu(64)
    blocks = {kind: torch.from_numpy(random_blocks(kind, n, k, rng)) for kind in types}
    repacked = {kind: gguf_repack.repack(int(kind), raw, k) for kind, raw in blocks.items()} \
        if gguf_repack.available() else {}
    results = {}
    for m in rows:
        x = torch.randn(m, k)
        out = torch.empty(m, n)
        fns = {"float32": lambda: dense(x)}
        for kind, raw in blocks.items():
            fns[f"{kind.name} dot"] = lambda kind=kind, raw=raw: gguf_dot.dot_rows(
                int(kind), raw, gguf_dot.quantize_rows(x), out)
            fns[f"{kind.name} panel"] = lambda kind=kind, raw=raw: panel_linear(x, int(kind), raw, k, out)
            if kind in repacked:
                fns[f"{kind.name} repacked"] = lambda w=repacked[kind]: gguf_repack.dot(
                    w, gguf_dot.quantize_rows(x), out)
        times = {name: [] for name in fns}
        reps = max(2, 64 // m)
        for fn in fns.values():
            fn()
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(_time(fn, reps))
        gops = {name: round(2 * m * n * k / statistics.median(t) / 1e9, 2) for name, t in times.items()}
        results[str(m)] = gops
        print(f"rows {m:4d}: float32 {gops['float32']:6.1f} GOP/s | "
              + " ".join(f"{kind.name} {gops.get(f'{kind.name} repacked', 0):.0f}/{gops[f'{kind.name} dot']:.0f}/"
                         f"{gops[f'{kind.name} panel']:.0f}" for kind in types), flush=True)
    return {"shape": {"out_features": n, "in_features": k}, "gops_per_s": results,
            "note": "repacked = activations quantized + the repacked GEMM (ops.gguf_repack); dot = activations "
                    "quantized + block dot product; panel = dequantize + oneDNN (quantization.gguf.panel_linear)"}


def _throughput(llm, workload) -> float:
    t0 = time.perf_counter()
    outs = common.generate_greedy(llm, workload.prompts, workload.output_lens[0])
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def model_part(rounds: int, models: list[str], batch1_tokens: int) -> dict:
    from pagedllm import LLM

    results = {}
    for label, model in MODELS.items():
        if model not in models:
            continue
        engines = {q or "float32": LLM(model=model, max_model_len=1024, kv_cache_memory="640MiB", max_num_seqs=64,
                                       quantization=q) for q in (None, "gguf")}
        workloads = {"batch 1": common.peers_workload(1, seed=1, output_len=batch1_tokens),
                     **{f"batch {b}": common.peers_workload(b, seed=b, output_len=64) for b in (4, 16)},
                     "peers (32 x 128)": common.peers_workload()}
        tok_s = {w: {e: [] for e in engines} for w in workloads}
        for name, llm in engines.items():  # warm-up: kernels built, first-step costs paid
            common.generate_greedy(llm, common.peers_workload(4, seed=9, output_len=8).prompts, 8)
        for r in range(rounds):
            for wname, wl in workloads.items():
                fresh = common.with_fresh_prompts(wl, r + 1)
                for name, llm in engines.items():
                    tok_s[wname][name].append(round(_throughput(llm, fresh), 2))
                    print(f"{label} {wname} round {r}: {name} {tok_s[wname][name][-1]} tok/s", flush=True)
        weight_bytes = {name: llm.llm_engine.runner.weight_bytes() for name, llm in engines.items()}
        results[label] = {
            "tok_s": tok_s, "weight_bytes": weight_bytes,
            "gguf_over_float32": {w: round(statistics.median(v["gguf"]) / statistics.median(v["float32"]), 3)
                                  for w, v in tok_s.items()}}
        print(label, results[label]["gguf_over_float32"], flush=True)
        del engines
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", nargs="+", default=["kernels", "models"], choices=["kernels", "models"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-rounds", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=list(MODELS.values()))
    ap.add_argument("--batch1-tokens", type=int, default=64)
    ap.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    ap.add_argument("--types", nargs="+", default=[t.name for t in TYPES])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    record = {"path": {0: "portable C", 1: "AVX2", 2: "AVX512-VNNI"}[gguf_dot.isa()]}
    if "kernels" in args.part:
        record["kernels"] = kernel_part(args.rounds, args.rows, [Q[t] for t in args.types])
    if "models" in args.part:
        record["models"] = model_part(args.model_rounds, args.models, args.batch1_tokens)
    record["load_average_end"] = [round(x, 2) for x in __import__("os").getloadavg()]
    print("wrote", common.write_result("gguf_kernels", record, args.out))


if __name__ == "__main__":
    main()
