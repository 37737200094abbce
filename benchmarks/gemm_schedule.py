"""The skinny GEMM's panel schedule: one contiguous range per thread vs dynamic grabs, with and without a neighbour.

On a shared machine (the HTTP server's event loop, the benchmark client, another tenant) one of
the OpenMP threads is preempted now and then; with a static split the whole team then waits at
the barrier for that thread's panels. The dynamic schedule (``skinny_gemm.c``, ``SG_GRABS`` grabs
per thread) lets the running threads take them. This benchmark builds the kernel twice,
``-DSG_GRABS=1`` (one grab per thread: the static split) and the default, and alternates one
model pass of SmolLM2's linears (30 layers of qkv/o/gate_up/down plus the LM head, weights from
memory) between the two, first on a quiet machine and then beside a process that spins
``--noise-duty`` percent of every 2 ms (a stand-in for a client or a neighbour). Reports the
median ms per pass and checks that both schedules give bitwise-equal outputs (each panel is
computed by one thread in the same k-order whichever thread takes it).

    .venv/bin/python benchmarks/gemm_schedule.py --rows 1,8,32,64 --noise-duty 30
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import common
import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

from pagedllm.ops import skinny_gemm

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K): qkv, o, gate_up, down
LAYERS = 30
LM_HEAD = (49152, 576)

NOISE_SOURCE = """
import sys, time
duty = float(sys.argv[1]) / 100
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.002 * duty:
        pass
    time.sleep(0.002 * (1 - duty))
"""


def start_noise(duty_percent: float) -> subprocess.Popen | None:
    """A process busy ``duty_percent`` % of each 2 ms period, or None for 0."""
    if duty_percent <= 0:
        return None
    return subprocess.Popen([sys.executable, "-c", NOISE_SOURCE, str(duty_percent)])


def one_condition(kernels: dict, packed: list, xs: dict, rounds: int) -> dict:
    """Median and minimum ms per model pass for each kernel, passes alternated between kernels."""
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, kernel in kernels.items():
            t = time.perf_counter()
            for p in packed:
                skinny_gemm.skinny_linear(xs[p.in_features], p, kernel)
            times[name].append(time.perf_counter() - t)
    return {name: {"median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3} for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,64", help="activation rows (decode batch) per pass")
    ap.add_argument("--rounds", type=int, default=12, help="passes per kernel per condition")
    ap.add_argument("--noise-duty", type=float, default=30, help="percent busy of the neighbour process; 0: quiet only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernels = {"static": skinny_gemm.load_kernel(("-DSG_GRABS=1",)), "dynamic": skinny_gemm.load_kernel()}
    if any(k is None for k in kernels.values()):
        raise SystemExit("the skinny GEMM kernel cannot be built here (no C compiler?)")
    g = torch.Generator().manual_seed(0)
    shapes = SHAPES * LAYERS + [LM_HEAD]
    width = kernels["dynamic"].panel_width
    packed = [skinny_gemm.pack_panels(torch.randn(n, k, generator=g) * 0.05, None, width) for n, k in shapes]
    duties = [0.0] + ([args.noise_duty] if args.noise_duty > 0 else [])
    results = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k, generator=g) for k in {k for _, k in shapes}}
        equal = torch.equal(skinny_gemm.skinny_linear(xs[576], packed[-1], kernels["static"]),
                            skinny_gemm.skinny_linear(xs[576], packed[-1], kernels["dynamic"]))
        results[rows] = {"bitwise_equal": equal}
        for duty in duties:
            noise = start_noise(duty)
            try:
                cond = one_condition(kernels, packed, xs, args.rounds)
            finally:
                if noise is not None:
                    noise.kill()
                    noise.wait()
            cond["static_over_dynamic"] = cond["static"]["median_ms"] / cond["dynamic"]["median_ms"]
            results[rows][f"noise_{duty:g}pct"] = cond
            print(f"rows {rows:3d} noise {duty:4.0f}%: static {cond['static']['median_ms']:7.1f} ms, dynamic "
                  f"{cond['dynamic']['median_ms']:7.1f} ms (static/dynamic x{cond['static_over_dynamic']:.3f}); "
                  f"bitwise equal {equal}", flush=True)
    record = {"threads": torch.get_num_threads(), "vector_width": kernels["dynamic"].vector_width,
              "rounds": args.rounds, "layers": LAYERS, "lm_head": list(LM_HEAD), "results": results}
    print(f"-> {common.write_result('gemm_schedule', record, args.out)}")


if __name__ == "__main__":
    main()
