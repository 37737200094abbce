"""Automatic prefix caching: 64 requests sharing a ~1,000-token system prompt.

Each request is the same shared prefix (``--prefix-len`` tokens, seeded ordinary token
ids standing in for a long system prompt) followed by a distinct question
(16–48 tokens), generating ``--max-tokens`` tokens greedily with EOS ignored. Two
engines, identical but for ``enable_prefix_caching``, run the same requests
alternately; each repeat uses a fresh prefix so no repeat starts with a warm cache.

Reported per engine: throughput (output and prompt+output tokens/s) of the burst (all
requests submitted at once), TTFT percentiles within the burst (queueing included),
the prefix-cache hit rate (prompt tokens served from cache ÷ prompt tokens looked up,
from ``LLMEngine.get_stats()``), and the TTFT of one extra request alone after the burst
(same prefix, new question): with caching on it computes only its question.
Greedy outputs must agree token for token between the two engines.

    python benchmarks/prefix_cache.py
    python benchmarks/prefix_cache.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import common

sys.path.insert(0, str(common.REPO_ROOT))


def make_requests(seed: int, num_requests: int, prefix_len: int, question_min: int = 16,
                  question_max: int = 48) -> tuple[list[int], list[list[int]]]:
    """(shared prefix, prompts): ``num_requests`` prompts = prefix + a distinct random question."""
    rng = np.random.default_rng(seed)
    prefix = common.random_prompts(rng, np.array([prefix_len]))[0]
    qlens = rng.integers(question_min, question_max + 1, size=num_requests + 1)
    questions = common.random_prompts(rng, qlens)
    return prefix, [prefix + q for q in questions]


def percentiles(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"p50": round(s[len(s) // 2], 4), "p90": round(s[int(0.9 * (len(s) - 1))], 4),
            "mean": round(sum(s) / len(s), 4), "max": round(s[-1], 4)}


def run_burst(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit ``prompts`` at once; timings, TTFTs, cache-hit delta and output ids."""
    from pagedllm import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = llm.llm_engine.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    after = llm.llm_engine.get_stats()
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed in the engine, first: {errors[0]}")
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {"elapsed_s": elapsed, "ttft_s": [o.metrics.time_to_first_token for o in outs],
            "num_prompt_tokens": sum(len(x) for x in prompts),
            "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "hit_rate": hits / queries if queries else 0.0, "hit_tokens": hits,
            "num_preemptions": after.num_preemptions_total - before.num_preemptions_total,
            "output_token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--kv-cache-memory", default="3GiB",
                   help="KV pool; 3 GiB (69.9k float32 tokens) holds all 64 uncached sequences at their "
                        "full length (~68.6k tokens), so 'off' is not slowed by preemption")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="8 requests, 200-token prefix")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.prefix_len, args.max_tokens, args.kv_cache_memory = 8, 200, 4, "256MiB"
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    from pagedllm import LLM
    engines = {}
    for on in (True, False):
        llm = LLM(model="smollm2-135m-instruct", dtype=args.dtype, enable_prefix_caching=on, seed=0,
                  max_model_len=args.prefix_len + 512, max_num_seqs=args.max_num_seqs,
                  kv_cache_memory=args.kv_cache_memory)
        _, warm = make_requests(10_000 + args.seed, 4, 64)
        run_burst(llm, warm, 4)  # warm-up on an unrelated prefix
        engines["on" if on else "off"] = llm
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    alone: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(args.repeats):
        prefix, prompts = make_requests(args.seed + r, args.num_requests, args.prefix_len)
        for name in (["on", "off"] if r % 2 == 0 else ["off", "on"]):
            runs[name].append(run_burst(engines[name], prompts[:-1], args.max_tokens))
            alone[name].append(run_burst(engines[name], prompts[-1:], 1)["ttft_s"][0])
    num_prompt = runs["on"][0]["num_prompt_tokens"]
    systems = {}
    for name, rs in runs.items():
        systems[f"prefix_caching_{name}"] = {
            "elapsed_s": [round(r["elapsed_s"], 3) for r in rs],
            "output_tokens_per_s": round(statistics.median(r["num_output_tokens"] / r["elapsed_s"] for r in rs), 2),
            "total_tokens_per_s": round(statistics.median(
                (r["num_output_tokens"] + r["num_prompt_tokens"]) / r["elapsed_s"] for r in rs), 2),
            "ttft_s": percentiles(rs[-1]["ttft_s"]), "hit_rate": round(rs[-1]["hit_rate"], 4),
            "hit_tokens": rs[-1]["hit_tokens"], "num_preemptions": rs[-1]["num_preemptions"],
            "ttft_alone_s": round(statistics.median(alone[name]), 4)}
    agree = common_agreement(runs["on"][-1]["output_token_ids"], runs["off"][-1]["output_token_ids"])
    on, off = systems["prefix_caching_on"], systems["prefix_caching_off"]
    record = {"num_requests": args.num_requests, "prefix_len": args.prefix_len, "max_tokens": args.max_tokens,
              "num_prompt_tokens": num_prompt, "dtype": args.dtype, "repeats": args.repeats,
              "systems": systems, "greedy_agreement_on_vs_off": agree,
              "speedup_throughput": round(on["output_tokens_per_s"] / off["output_tokens_per_s"], 3),
              "speedup_ttft_p50": round(off["ttft_s"]["p50"] / on["ttft_s"]["p50"], 3),
              "speedup_ttft_alone": round(off["ttft_alone_s"] / on["ttft_alone_s"], 3)}
    path = common.write_result("prefix_cache" + ("_quick" if args.quick else ""), record, args.out)
    if not args.no_plot:
        plot(record, common.plot_path(path))
    print(f"prefix_cache [{args.num_requests} req, {args.prefix_len}-token shared prefix, {args.dtype}]: "
          f"hit rate {100 * on['hit_rate']:.1f}% (off: {100 * off['hit_rate']:.1f}%); throughput "
          f"{on['output_tokens_per_s']:.1f} vs {off['output_tokens_per_s']:.1f} output tok/s "
          f"({record['speedup_throughput']:.2f}x); TTFT p50 {on['ttft_s']['p50']:.3f} vs {off['ttft_s']['p50']:.3f} s "
          f"({record['speedup_ttft_p50']:.2f}x); TTFT alone {on['ttft_alone_s']:.3f} vs {off['ttft_alone_s']:.3f} s "
          f"({record['speedup_ttft_alone']:.2f}x); greedy agreement {100 * agree:.0f}% -> {path}")
    return record


def common_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests with identical output token ids."""
    return sum(1 for x, y in zip(a, b) if x == y) / max(len(a), 1)


def plot(record: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    on, off = record["systems"]["prefix_caching_on"], record["systems"]["prefix_caching_off"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    for ax, key, label in ((axes[0], "total_tokens_per_s", "prompt+output tokens/s"),
                           (axes[1], None, "TTFT in the burst, s (p50 / p90)"),
                           (axes[2], "ttft_alone_s", "TTFT of one request alone, s")):
        if key is None:
            xs = np.arange(2)
            ax.bar(xs - 0.2, [on["ttft_s"]["p50"], off["ttft_s"]["p50"]], 0.4, label="p50")
            ax.bar(xs + 0.2, [on["ttft_s"]["p90"], off["ttft_s"]["p90"]], 0.4, label="p90")
            ax.set_xticks(xs, ["caching on", "caching off"])
            ax.legend(fontsize=7)
        else:
            ax.bar(["caching on", "caching off"], [on[key], off[key]], color=["tab:green", "tab:gray"])
        ax.set_title(label, fontsize=9)
    fig.suptitle(f"{record['num_requests']} requests sharing a {record['prefix_len']}-token prefix "
                 f"(hit rate {100 * on['hit_rate']:.0f}%)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1:])
