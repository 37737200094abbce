"""CPU decode graphs against eager decode steps, on the real model, alternated in one process.

Two engines on the same weights, one with ``enforce_eager=True`` (every step runs the layers'
Python) and one with the CPU decode graphs (pagedllm/worker/cpu_graph.py, the default). For each
batch size, ``--rounds`` rounds alternate the two (eager first in even rounds, graphs first in odd
ones): ``batch`` requests of ``--prompt-len`` random tokens are prefilled, a few decode steps warm
up (the graph is captured on its size's second step), then ``--steps`` decode steps are timed one
by one. Reports the median step time of each engine per round, the ratio graphs / eager of the
medians over rounds, and whether the two engines' greedy tokens were identical. One result line;
JSON to benchmarks/results/cpu_graph.json.

    .venv/bin/python benchmarks/cpu_graph.py --batches 1,8,32,64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

from pagedllm import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info  # noqa: E402

MODES = ("eager", "graphs")


def time_decode_steps(llm: LLM, prompts: list[list[int]], warmup: int, steps: int) -> tuple[list[float], list]:
    """Prefill ``prompts``, ``warmup`` decode steps, then ``steps`` timed ones (seconds each);
    runs the requests to the end and returns (step times, token ids per request)."""
    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 2, ignore_eos=True)
    ids = [eng.add_request(None, p, params) for p in prompts]
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
    outputs = {}
    for _ in range(warmup):
        outputs.update({o.request_id: o for o in eng.step()})
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outputs.update({o.request_id: o for o in eng.step()})
        times.append(time.perf_counter() - t0)
    while eng.has_unfinished_requests():
        outputs.update({o.request_id: o for o in eng.step()})
    return times, [outputs[i].outputs[0].token_ids for i in ids]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,8,32,64", help="comma-separated decode batch sizes")
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--out", default="benchmarks/results/cpu_graph.json")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    llms = {m: LLM(model=args.model, dtype=args.dtype, kv_cache_memory="1GiB", enable_prefix_caching=False,
                   max_num_seqs=max(batches), enforce_eager=(m == "eager")) for m in MODES}
    rng = random.Random(0)
    results = {}
    for batch in batches:
        per_mode = {m: [] for m in MODES}
        identical = True
        for rnd in range(args.rounds):
            prompts = [[rng.randrange(3, 49000) for _ in range(args.prompt_len)] for _ in range(batch)]
            tokens = {}
            for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
                times, tokens[mode] = time_decode_steps(llms[mode], prompts, args.warmup, args.steps)
                per_mode[mode].append(statistics.median(times))
            identical = identical and tokens["eager"] == tokens["graphs"]
        ratio = statistics.median(per_mode["graphs"]) / statistics.median(per_mode["eager"])
        results[batch] = {"step_ms": {m: [round(t * 1e3, 2) for t in per_mode[m]] for m in MODES},
                          "graphs_over_eager": round(ratio, 3), "greedy_tokens_identical": identical}
    graphs = llms["graphs"].llm_engine.runner.cpu_graphs
    rec = {"benchmark": "cpu_graph", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine_info(),
           "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()], "dtype": args.dtype,
           "prompt_len": args.prompt_len, "rounds": args.rounds, "steps": args.steps,
           "torch_threads": torch.get_num_threads(), "results": results,
           "graphs": {"captured": graphs.num_captured, "replayed": graphs.num_replayed,
                      "refused": {f"{k[0]} rows": v for k, v in graphs.refused.items()}},
           "command": "benchmarks/cpu_graph.py " + " ".join(argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=2))
    print(f"cpu graphs [{args.dtype}], decode step graphs / eager: "
          + ", ".join(f"batch {b} {r['graphs_over_eager']:.3f}x ({statistics.median(r['step_ms']['graphs']):.1f} vs "
                      f"{statistics.median(r['step_ms']['eager']):.1f} ms, tokens "
                      f"{'identical' if r['greedy_tokens_identical'] else 'DIFFER'})" for b, r in results.items())
          + f" -> {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
