"""Served throughput with data parallelism: `pagedllm serve --data-parallel-size 2` against 1.

The peers' workload (``/work/shared/peers.md``: 32 prompts of 20–200 random tokens, exactly
128 new tokens each, greedy, all sent at once) is sent by ``benchmarks/serving.py`` to a
server it launches, alternating DP=1 and DP=2 (order swapped every round, since this
machine's load drifts); each round's DP=2 / DP=1 ratio is of two neighbouring runs.
On CPU each replica gets ``cores / N`` torch threads, so DP=2 on 2 cores trades one
2-thread engine for two 1-thread engines: it pays when a step's time does not halve with
twice the threads (small batches, Python overhead per step).

Writes ``benchmarks/results/scaling_dp.json`` (input of ``benchmarks/scaling.py``) and prints
one line.

    python benchmarks/data_parallel.py --rounds 2            # engine flags after --
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PEERS_WORKLOAD = ["--num-prompts", "32", "--input-len-min", "20", "--input-len-max", "200",
                  "--output-len-min", "128", "--output-len-max", "128", "--seed", "0"]


def run_one(data_parallel_size: int, workload: list[str], engine_flags: list[str]) -> dict:
    """One launched server under the workload; serving.py's record."""
    with tempfile.TemporaryDirectory() as tmp:
        return serving.main(["--launch", *workload, "--label", f"dp{data_parallel_size}",
                             "--out", str(Path(tmp) / "run.json"), "--",
                             "--data-parallel-size", str(data_parallel_size), *engine_flags])


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_flags: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, engine_flags = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="DP=1/DP=2 pairs (order alternates)")
    p.add_argument("--workload", nargs=argparse.REMAINDER, default=None,
                   help="serving.py workload flags (default: the peers' workload)")
    p.add_argument("--out", default=str(RESULTS / "scaling_dp.json"))
    args = p.parse_args(argv)
    workload = args.workload or PEERS_WORKLOAD
    runs, ratios = [], []
    for r in range(args.rounds):
        pair = {}
        for dp in ((1, 2) if r % 2 == 0 else (2, 1)):
            rec = run_one(dp, workload, engine_flags)
            pair[dp] = rec
            runs.append({"round": r, "data_parallel_size": dp, **{k: rec[k] for k in (
                "num_success", "num_requests", "duration_s", "output_throughput_tok_s", "total_throughput_tok_s",
                "ttft_ms", "itl_ms", "e2e_ms", "health_ms", "load_average_1_5_15min") if k in rec}})
        ratios.append(pair[2]["output_throughput_tok_s"] / pair[1]["output_throughput_tok_s"])
    by_dp = {dp: [x["output_throughput_tok_s"] for x in runs if x["data_parallel_size"] == dp] for dp in (1, 2)}
    record = {
        "benchmark": "data_parallel", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu_count": os.cpu_count(),
        "workload": workload, "engine_flags": engine_flags, "model": "smollm2-135m-instruct (GGUF, default flags)",
        "threads_per_replica": {"1": os.cpu_count(), "2": max(1, (os.cpu_count() or 1) // 2)},
        "runs": runs, "output_tok_s": {str(k): v for k, v in by_dp.items()},
        "ratio_dp2_over_dp1_per_round": ratios, "ratio_dp2_over_dp1_median": statistics.median(ratios),
        "note": "ratios of neighbouring runs on a shared 2-core machine; see load_average_1_5_15min per run",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"data parallel: DP=1 {', '.join(f'{x:.1f}' for x in by_dp[1])} out tok/s, DP=2 "
          f"{', '.join(f'{x:.1f}' for x in by_dp[2])} out tok/s; DP=2/DP=1 per round "
          f"{', '.join(f'{x:.2f}' for x in ratios)} -> {args.out}")
    return record


if __name__ == "__main__":
    main()
