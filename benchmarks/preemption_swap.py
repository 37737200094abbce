"""Preemption-heavy trace: recompute vs swap vs auto preemption.

``--num-requests`` requests with long prompts (uniform in [``--prompt-min``,
``--prompt-max``]) and ``--max-tokens`` output tokens each (EOS ignored) are submitted
at once to an engine whose KV pool (``--pool-blocks`` blocks of 16 tokens) holds only a
few of them at full length, so the scheduler preempts again and again. Three engines,
identical but for ``preemption_mode``, run the same burst alternately (prefix caching
off, so a recomputed victim really recomputes).

Reported per engine: elapsed time, output and prompt+output throughput, preemptions by
mode, prompt tokens computed (recompute work included), and whether greedy outputs
agree token for token.

    python benchmarks/preemption_swap.py
    python benchmarks/preemption_swap.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

import common

sys.path.insert(0, str(common.REPO_ROOT))

MODES = ("recompute", "swap", "auto")


def run_burst(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    before = llm.llm_engine.get_stats()
    t0 = time.perf_counter()
    outs = common.generate_greedy(llm, prompts, max_tokens)
    elapsed = time.perf_counter() - t0
    after = llm.llm_engine.get_stats()
    return {"elapsed_s": elapsed, "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "prompt_tokens_computed": after.prompt_tokens_total - before.prompt_tokens_total,
            "preemptions": dict(Counter(m for o in outs for m in o.metrics.preemption_modes)),
            "output_token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-min", type=int, default=200)
    p.add_argument("--prompt-max", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--pool-blocks", type=int, default=160, help="KV pool blocks of 16 tokens")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--swap-space", default="2GiB")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="6 requests, short prompts")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.prompt_min, args.prompt_max, args.max_tokens = 6, 40, 100, 24
        args.pool_blocks, args.max_num_seqs, args.swap_space = 16, 6, "256MiB"
    from pagedllm import LLM
    rng = np.random.default_rng(args.seed)
    prompts = common.random_prompts(rng, rng.integers(args.prompt_min, args.prompt_max + 1, size=args.num_requests))
    engines = {m: LLM(model="smollm2-135m-instruct", dtype="float32", seed=0, enable_prefix_caching=False,
                      max_model_len=args.prompt_max + args.max_tokens + 16, num_kv_blocks=args.pool_blocks,
                      max_num_seqs=args.max_num_seqs, preemption_mode=m, swap_space=args.swap_space)
               for m in MODES}
    for llm in engines.values():  # warm-up (also gives auto its first prefill measurements)
        run_burst(llm, common.random_prompts(np.random.default_rng(10_000), np.array([128, 64])), 2)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for m in (MODES if r % 2 == 0 else MODES[::-1]):
            runs[m].append(run_burst(engines[m], prompts, args.max_tokens))
    num_prompt = sum(len(x) for x in prompts)
    systems = {}
    for m, rs in runs.items():
        last = rs[-1]
        systems[m] = {"elapsed_s": [round(x["elapsed_s"], 3) for x in rs],
                      "output_tokens_per_s": round(statistics.median(x["num_output_tokens"] / x["elapsed_s"] for x in rs), 2),
                      "total_tokens_per_s": round(statistics.median(
                          (x["num_output_tokens"] + num_prompt) / x["elapsed_s"] for x in rs), 2),
                      "preemptions_by_mode": last["preemptions"],
                      "prompt_tokens_computed": last["prompt_tokens_computed"],
                      "swap": {"copy_bytes_per_s": engines[m].llm_engine.scheduler.swap_space.copy_bytes_per_s,
                               "prefill_s_per_token": engines[m].llm_engine.scheduler.swap_space.prefill_s_per_token,
                               "fallbacks": engines[m].llm_engine.scheduler.swap_space.num_fallbacks}}
    agree = all(runs[m][-1]["output_token_ids"] == runs["recompute"][-1]["output_token_ids"] for m in MODES)
    base = systems["recompute"]["output_tokens_per_s"]
    record = {"num_requests": args.num_requests, "prompt_len": [args.prompt_min, args.prompt_max],
              "num_prompt_tokens": num_prompt, "max_tokens": args.max_tokens, "pool_blocks": args.pool_blocks,
              "max_num_seqs": args.max_num_seqs, "swap_space": args.swap_space, "repeats": args.repeats,
              "systems": systems, "greedy_agreement": agree,
              "throughput_vs_recompute": {m: round(systems[m]["output_tokens_per_s"] / base, 3) for m in MODES}}
    path = common.write_result("preemption_swap" + ("_quick" if args.quick else ""), record, args.out)
    line = "; ".join(f"{m}: {systems[m]['output_tokens_per_s']:.1f} output tok/s, preemptions "
                     f"{systems[m]['preemptions_by_mode']}, {systems[m]['prompt_tokens_computed']} prompt tokens "
                     f"computed" for m in MODES)
    print(f"preemption_swap [{args.num_requests} req, pool {args.pool_blocks} blocks]: {line}; "
          f"greedy agreement {agree} -> {path}")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
