"""Offline throughput under OpenMP wait policies: why pagedllm no longer forces PASSIVE.

A decode step is hundreds of short parallel regions (torch's linears, the C kernels)
separated by Python. ``OMP_WAIT_POLICY=PASSIVE`` puts the idle team to sleep after every
region, so each region starts with a futex wake-up; libgomp's default spins for a while
first (``GOMP_SPINCOUNT``), ``ACTIVE`` spins forever. This runs the peers workload
(``throughput.py --workload peers``) in a fresh process per policy (the variable is read
once, when libgomp loads), alternating the policies in every round so a noisy neighbour
hits them all alike, and reports output tok/s and the ratio to PASSIVE per round.
``--background-load N`` runs N busy processes for the whole benchmark: a machine shared with
other work, reproducibly.

Usage::

    python benchmarks/omp_wait_policy.py --dtype float32 --rounds 2     # ~3 min
    python benchmarks/omp_wait_policy.py --dtype bfloat16 --rounds 3
    python benchmarks/omp_wait_policy.py --num-requests 4 --background-load 6   # contended
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common

# name -> environment changes ("" removes the variable: libgomp's own default).
POLICIES = {
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": ""},
    "spin-1k": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "1000"},
    "spin-3k": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "3000"},
    "spin-10k": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "10000"},
    "spin-100k": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "100000"},
    "libgomp-default": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": ""},
    "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": ""},
}


def run_once(policy: str, dtype: str, num_requests: int) -> float:
    """Output tok/s of one peers run of pagedllm under ``policy``, in a fresh process."""
    env = dict(os.environ)
    for k, v in POLICIES[policy].items():
        if v:
            env[k] = v
        else:
            env.pop(k, None)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, str(common.BENCH_DIR / "throughput.py"), "--workload", "peers",
               "--mode", "continuous", "--dtype", dtype, "--reference-dtype", "", "--repeats", "1",
               "--num-requests", str(num_requests), "--out", str(out), "--no-plot"]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        record = json.loads(out.read_text())
    return record["systems"]["pagedllm-continuous"]["output_tokens_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of " + ",".join(POLICIES))
    p.add_argument("--background-load", type=int, default=0, help="busy processes running meanwhile")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    policies = [x for x in args.policies.split(",") if x]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"--policies: unknown {sorted(unknown)}; known: {list(POLICIES)}")
    runs: dict[str, list[float]] = {name: [] for name in policies}
    loads = []
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.background_load)]
    try:
        for r in range(args.rounds):
            for name in policies:
                loads.append([round(x, 2) for x in os.getloadavg()])
                runs[name].append(run_once(name, args.dtype, args.num_requests))
                print(f"round {r + 1}/{args.rounds} {name}: {runs[name][-1]:.1f} output tok/s", flush=True)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    record = {
        "workload": {"name": "peers", "num_requests": args.num_requests},
        "background_load_processes": args.background_load,
        "dtype": args.dtype,
        "policies": POLICIES,
        "load_average_before_each_run": loads,
        "output_tokens_per_s": {k: {"runs": v, "median": statistics.median(v)} for k, v in runs.items()},
    }
    if "PASSIVE" in runs:
        record["ratio_to_passive_per_round"] = {
            k: [round(a / b, 3) for a, b in zip(v, runs["PASSIVE"])] for k, v in runs.items() if k != "PASSIVE"}
    path = common.write_result(f"omp_wait_policy_{args.dtype}", record, args.out)
    summary = ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in runs.items())
    print(f"omp wait policy [peers, {args.dtype}] median output tok/s: {summary} -> {path}")


if __name__ == "__main__":
    main()
