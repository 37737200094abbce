"""Tensor parallelism on CPU: TP=1 vs TP=2 on the peers workload, and what a step spends in
all-reduce — the measured side of ``docs/scaling.md``'s model.

For each configuration the engine is built (load and warm-up excluded), the workload is
generated greedily (EOS ignored, every request exactly ``--output-len`` tokens), and every
rank reports (through ``LLM.collective_rpc``): its resident memory (VmRSS, peak VmHWM), its
weight bytes and KV-pool bytes, and its collective counters
(:mod:`pagedllm.distributed.communication`: calls, payload bytes, seconds inside the call).
Configurations (run alternately, ``--repeats`` rounds):

- ``tp1-1t``: one rank, one thread;
- ``tp1-2t``: one rank, two threads (the cores TP=2 uses);
- ``tp2-1t``: two gloo ranks, one thread each.

The model is Gemma 3 270M (``gemma3-270m``, GGUF dequantized to float32): SmolLM2's 9
attention heads do not split over 2 ranks, Gemma 3 270M's 4 do (its one KV head is
replicated on both ranks). The all-reduce payload per token predicted by the model —
``(2 × layers + 1) × hidden × dtype bytes`` (o and down projections of every layer, plus the
embedding) — is recorded beside the measured one. DP figures, when the data-parallel
benchmark has written ``results/scaling_dp.json``, are copied into the record.

    python benchmarks/scaling.py                 # ~10 minutes on 2 cores
    python benchmarks/scaling.py --quick         # 8 requests x 32 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import common

CONFIGS = {"tp1-1t": (1, 1), "tp1-2t": (1, 2), "tp2-1t": (2, 1)}  # name -> (tensor_parallel_size, threads per rank)


def _rank_report(runner) -> dict:
    """This rank's memory and collective counters (runs on every rank)."""
    import torch

    from pagedllm.distributed.communication import collective_stats
    from pagedllm.distributed.parallel_state import get_tensor_parallel_rank
    from pagedllm.quantization import weight_bytes

    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                status[key] = int(value.split()[0]) * 1024
    return {"rank": get_tensor_parallel_rank(), "pid": os.getpid(), "threads": torch.get_num_threads(),
            "rss_bytes": status.get("VmRSS"), "peak_rss_bytes": status.get("VmHWM"),
            "weight_bytes": weight_bytes(runner.model),
            "kv_pool_bytes": sum(t.numel() * t.element_size() for t in runner.kv_caches),
            "collectives": collective_stats()}


def _reset(runner) -> None:
    from pagedllm.distributed.communication import reset_collective_stats

    reset_collective_stats()


def run_config(name: str, model: str, workload, engine_options: dict) -> dict:
    import torch

    from pagedllm import LLM

    tp, threads = CONFIGS[name]
    torch.set_num_threads(threads)  # rank 0 (this process); workers take cores // ranks = 1 here
    t0 = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, **engine_options)
    try:
        # warm-up on other prompts: the workload's own would be prefix-cache hits in the measured run
        common.generate_greedy(llm, common.peers_workload(2, seed=1).prompts, 4)
        load_s = time.perf_counter() - t0
        llm.collective_rpc(_reset)
        steps0 = llm.llm_engine.num_steps
        start = time.perf_counter()
        common.generate_greedy(llm, workload.prompts, workload.output_lens[0])
        elapsed = time.perf_counter() - start
        ranks = llm.collective_rpc(_rank_report)
        steps = llm.llm_engine.num_steps - steps0
        hf = llm.llm_engine.model_files.hf_config
    finally:
        llm.llm_engine.shutdown()
    tokens = workload.num_prompt_tokens + workload.num_output_tokens
    ar = ranks[0]["collectives"]["all_reduce"]
    ag = ranks[0]["collectives"]["all_gather"]
    return {
        "config": name, "tensor_parallel_size": tp, "threads_per_rank": threads, "load_and_warmup_s": round(load_s, 2),
        "seconds": round(elapsed, 3), "steps": steps,
        "output_tokens_per_s": round(workload.num_output_tokens / elapsed, 2),
        "total_tokens_per_s": round(tokens / elapsed, 2),
        "ranks": ranks,
        "rank0_all_reduce_share_of_time": round(ar["seconds"] / elapsed, 4) if tp > 1 else 0.0,
        "rank0_all_gather_share_of_time": round(ag["seconds"] / elapsed, 4) if tp > 1 else 0.0,
        "all_reduce_calls_per_step": round(ar["calls"] / steps, 2) if steps else None,
        "all_reduce_ms_per_call": round(1e3 * ar["seconds"] / ar["calls"], 4) if ar["calls"] else None,
        "all_reduce_bytes_per_token": round(ar["bytes"] / tokens, 1),
        "all_reduce_bytes_per_token_model": (2 * hf.num_hidden_layers + 1) * hf.hidden_size * 4 if tp > 1 else 0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated: {', '.join(CONFIGS)}")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="8 requests x 32 tokens")
    p.add_argument("--kv-cache-memory", default="1GiB", help="KV pool per rank")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.quick:
        args.num_requests, args.output_len = 8, 32
    sys.path.insert(0, str(common.REPO_ROOT))
    workload = common.peers_workload(args.num_requests, output_len=args.output_len)
    engine_options = dict(dtype="float32", max_model_len=1024, max_num_seqs=128, kv_cache_memory=args.kv_cache_memory,
                          worker_timeout_s=600)
    names = args.configs.split(",")
    runs = []
    for repeat in range(args.repeats):
        for name in names:  # alternate the systems
            result = run_config(name, args.model, workload, engine_options)
            result["repeat"] = repeat
            runs.append(result)
            print(f"{name}: {result['output_tokens_per_s']} output tok/s, all-reduce share "
                  f"{result['rank0_all_reduce_share_of_time']:.1%}, {result['all_reduce_bytes_per_token']:.0f} B/token "
                  f"(model {result['all_reduce_bytes_per_token_model']}), rank memory "
                  f"{[round(r['rss_bytes'] / 2**20) for r in result['ranks']]} MiB", flush=True)
    best = {name: max(r["output_tokens_per_s"] for r in runs if r["config"] == name) for name in names}
    record = {"model": args.model, "workload": workload.summary(), "engine_options": engine_options,
              "repeats": args.repeats, "runs": runs, "best_output_tokens_per_s": best}
    if "tp1-2t" in best and "tp2-1t" in best:
        record["tp2_over_tp1_same_cores"] = round(best["tp2-1t"] / best["tp1-2t"], 3)
    if "tp1-1t" in best and "tp2-1t" in best:
        record["tp2_over_tp1_one_thread"] = round(best["tp2-1t"] / best["tp1-1t"], 3)
    dp = common.RESULTS_DIR / "scaling_dp.json"
    if dp.exists():
        record["data_parallel"] = json.loads(dp.read_text())
    path = common.write_result("scaling", record, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
