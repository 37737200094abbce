"""Continuous vs static batching without a model: the real scheduler, a roofline cost model.

Drives the engine's real :class:`pagedllm.core.scheduler.Scheduler` through the
throughput benchmark's workload (same seed, same engine options as ``throughput.py``),
with a fake model runner that samples a dummy token for every request that completes
its K/V, once with ``batching="continuous"`` and once with ``batching="static"``. Each
step's shape (tokens computed, sequences, K/V tokens read by attention) is priced with
two cost models:

- ``flat``: every step costs the same (decode on a GPU at small batch, where a step reads
  all weights once whatever the batch: the regime the 5–10x claim of Orca / vLLM
  comes from);
- ``roofline``: step time = max(weight bytes / bandwidth, tokens × 2·params / matmul
  rate) + K/V bytes read / bandwidth, with this machine's rates from
  ``benchmarks/results/roofline.json`` (or ``--bandwidth-gbs`` / ``--gflops``).

The ratio of the two policies' total time predicts the continuous/static throughput
ratio; comparing it with ``throughput.py``'s measured ratio shows how much of the gap
is scheduling and how much is the machine's cost per step.

    python benchmarks/batching_model.py
    python benchmarks/batching_model.py --num-requests 512
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import common

sys.path.insert(0, str(common.REPO_ROOT))
from pagedllm.config import EngineConfig  # noqa: E402
from pagedllm.core.outputs import ModelRunnerOutput  # noqa: E402
from pagedllm.core.request import Request  # noqa: E402
from pagedllm.core.scheduler import Scheduler  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

# SmolLM2-135M: matmul parameters, float32 K/V bytes per token (see roofline.ModelShape).
NUM_MATMUL_PARAMS = 134_479_872
KV_BYTES_PER_TOKEN_FP32 = 2 * 30 * 3 * 64 * 4


def replay(batching: str, wl: common.Workload, max_model_len: int, max_num_seqs: int,
           kv_cache_bytes: int, token_budget: int | None, block_size: int = 16) -> list[dict]:
    """Run ``wl`` through the real scheduler; one ``{tokens, seqs, kv_read}`` dict per step."""
    cfg = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs, batching=batching,
                       max_num_batched_tokens=token_budget, block_size=block_size)
    num_blocks = kv_cache_bytes // (block_size * KV_BYTES_PER_TOKEN_FP32)
    sched = Scheduler(cfg, num_blocks)
    for i, (prompt, n) in enumerate(zip(wl.prompts, wl.output_lens)):
        sched.add_request(Request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                                  eos_token_id=2, arrival_time=float(i)))
    steps: list[dict] = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        reqs = {r.request_id: r for r in sched.running}
        kv_read = 0
        sampled_ids = []
        for rid, n in so.num_scheduled_tokens.items():
            req = reqs[rid]
            kv_read += req.num_computed_tokens + n  # context each new token attends to (upper bound)
            if req.num_computed_tokens + n == req.num_tokens:
                sampled_ids.append(rid)
        steps.append({"tokens": so.total_num_scheduled_tokens, "seqs": len(so.num_scheduled_tokens),
                      "kv_read": kv_read})
        sched.update_from_output(so, ModelRunnerOutput(req_ids=sampled_ids, sampled_token_ids=[[100]] * len(sampled_ids)))
    return steps


def step_time(step: dict, model: str, bandwidth_gbs: float, gflops: float) -> float:
    """Seconds of one step under ``model`` (``flat``: 1 unit per step; ``roofline``: see module docstring)."""
    if model == "flat":
        return 1.0
    weights = NUM_MATMUL_PARAMS * 4 / (bandwidth_gbs * 1e9)
    compute = step["tokens"] * 2 * NUM_MATMUL_PARAMS / (gflops * 1e9)
    return max(weights, compute) + step["kv_read"] * KV_BYTES_PER_TOKEN_FP32 / (bandwidth_gbs * 1e9)


def machine_rates(path: Path, bandwidth: float | None, gflops: float | None) -> tuple[float, float, str]:
    """(bandwidth GB/s, float32 matmul GFLOP/s, source) from the flags or a roofline.py record."""
    if bandwidth and gflops:
        return bandwidth, gflops, "flags"
    if path.exists():
        rec = json.loads(path.read_text())
        return (bandwidth or rec["copy_bandwidth_gbs"], gflops or rec["dtypes"]["float32"]["matmul_gflops_model"],
                str(path))
    return bandwidth or 20.0, gflops or 200.0, "defaults (20 GB/s, 200 GFLOP/s; run roofline.py)"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="high-load", choices=["high-load", "peers"])
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--static-token-budget", type=int, default=32768)
    p.add_argument("--roofline-json", type=Path, default=common.RESULTS_DIR / "roofline.json")
    p.add_argument("--bandwidth-gbs", type=float, default=None)
    p.add_argument("--gflops", type=float, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from throughput import make_workload
    wl = make_workload(args.workload, False, args.seed, args.num_requests)
    bw, fl, src = machine_rates(args.roofline_json, args.bandwidth_gbs, args.gflops)
    kv = int(args.kv_cache_gib * 2**30)
    traces = {"continuous": replay("continuous", wl, args.max_model_len, args.max_num_seqs, kv, None),
              "static": replay("static", wl, args.max_model_len, args.max_num_seqs, kv, args.static_token_budget)}
    policies = {}
    for name, steps in traces.items():
        policies[name] = {"steps": len(steps),
                          "mean_seqs_per_step": round(sum(s["seqs"] for s in steps) / len(steps), 2),
                          "max_seqs_per_step": max(s["seqs"] for s in steps),
                          "time_flat_steps": len(steps),
                          "time_roofline_s": round(sum(step_time(s, "roofline", bw, fl) for s in steps), 2)}
        policies[name]["predicted_output_tokens_per_s"] = round(wl.num_output_tokens / policies[name]["time_roofline_s"], 1)
    c, s = policies["continuous"], policies["static"]
    record = {"workload": wl.summary(), "rates": {"bandwidth_gbs": bw, "gflops_fp32": fl, "source": src},
              "policies": policies,
              "ratio_flat": round(s["time_flat_steps"] / c["time_flat_steps"], 3),
              "ratio_roofline": round(s["time_roofline_s"] / c["time_roofline_s"], 3)}
    path = common.write_result("batching_model", record, args.out)
    print(f"batching_model [{wl.name}, {wl.num_requests} req]: continuous/static = {record['ratio_flat']:.2f}x "
          f"with a flat step cost (steps {c['steps']} vs {s['steps']}), {record['ratio_roofline']:.2f}x with this "
          f"machine's roofline ({bw:.0f} GB/s, {fl:.0f} GFLOP/s; predicted {c['predicted_output_tokens_per_s']:.0f} vs "
          f"{s['predicted_output_tokens_per_s']:.0f} output tok/s); mean seqs/step {c['mean_seqs_per_step']} vs "
          f"{s['mean_seqs_per_step']} -> {path}")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
