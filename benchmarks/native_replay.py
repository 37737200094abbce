"""CPU decode graphs replayed natively (one C loop, one OpenMP region per step, threads spinning between the
step's calls: ``pagedllm/ops/graph_replay.py``) against the same graphs replayed from Python (one ctypes call and,
for a threaded kernel, one OpenMP region per call: ``PAGEDLLM_CPU_GRAPH_NATIVE_REPLAY=0``), SmolLM2 under the
default PASSIVE wait policy.

Each (configuration, replay) runs in a child process of its own (the replay mode is read when a graph is
captured; a fresh process also leaves no threads behind), the two replays alternating A B / B A over the rounds:
output tok/s of ``quantization.py``'s chat prompts at each batch size (new tokens with EOS ignored) and of the peers'
workload (32 prompts of 20-200 tokens x 128 tokens, all in flight).

    .venv/bin/python benchmarks/native_replay.py [--configs float32 w8a8 gguf-q4_1 int4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import common

MODES = {"native": "1", "python": "0"}


def child(name: str, batches: list[int], tokens: int) -> dict:
    import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy
    from common import peers_workload
    from quantization import make_llm, peers_throughput, throughput

    llm = make_llm(name, "768MiB")
    convs = [[{"role": "user", "content": "Hi"}]]
    throughput(llm, convs, 2, 4)  # warm-up
    from bf16_accuracy import QUESTIONS

    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    result = {f"b{b}": round(throughput(llm, convs, b, tokens), 2) for b in batches}
    result["peers"] = round(peers_throughput(llm, peers_workload()), 2)
    return result


def run_child(args, name: str, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--batches", *map(str, args.batches), "--tokens",
           str(args.tokens)]
    from pagedllm import envs

    env = {**os.environ, envs.CPU_GRAPH_NATIVE_REPLAY.name: MODES[mode]}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["float32", "w8a8", "gguf-q4_1", "int4"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request at each batch size")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.batches, args.tokens)))
        return
    runs: dict[str, dict[str, list[dict]]] = {c: {m: [] for m in MODES} for c in args.configs}
    for r in range(args.rounds):
        for name in args.configs:
            for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
                runs[name][mode].append(run_child(args, name, mode))
                print(f"round {r} {name} {mode}: {runs[name][mode][-1]}", flush=True)
    ratios = {name: {key: [round(n[key] / p[key], 3) for n, p in zip(modes["native"], modes["python"])]
                     for key in modes["native"][0]} for name, modes in runs.items()}
    for name, per_key in ratios.items():
        print(f"{name} native / Python replay per round: " + ", ".join(f"{k} {v}" for k, v in per_key.items()))
    record = {"tok_s": runs, "native_over_python": ratios, "tokens": args.tokens,
              "load_average_end": [round(x, 2) for x in os.getloadavg()]}
    print("wrote", common.write_result("native_replay", record, args.out))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
