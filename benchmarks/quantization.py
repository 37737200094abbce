"""Quantization and batching: what weight formats and KV-cache dtypes buy and cost on SmolLM2.

For each weight format (float32, bfloat16, weight-only int8, W8A8 (int8 weights and activations),
int4 with its group chosen per layer (32 here: the file's Q4_1 grid), the GGUF's Q4_1 blocks kept
packed, the same with bfloat16 activations) with the KV cache in the model dtype, for float32
weights with the KV cache in bfloat16 / fp8 / int8, and W8A8 with an int8 KV cache, it measures:

- weight bytes (parameters and quantized buffers; the float formats also keep a
  oneDNN-prepacked copy of their projections, reported apart) and KV bytes per token;
- how many sequences of 2048 tokens fit in a fixed memory budget (weights + KV), for every
  weights x KV combination (arithmetic from the two measured sizes);
- output tokens/s at several batch sizes (each request: a chat prompt, new tokens with EOS
  ignored; 16 by default). Configurations run one after another in each round and the rounds repeat, so
  every configuration sees the same load over time; the median round is reported;
- accuracy against float32: greedy agreement over 64 tokens on 16 chat prompts (share of
  positions before the first divergence, prompts identical end to end), perplexity on a
  fixed local text from the engine's prompt logprobs (``benchmarks/data/apache-2.0.txt``, the
  Apache License 2.0, 2215 tokens; and the short ``tests/data/perplexity_text.txt``, 267 tokens,
  whose figure moves by several percent on any rounding change), and the max |logit difference|
  at the prompts' last position (weight formats; a plain forward without the KV cache);
- with ``--peers``: the peers' workload (``/work/shared/peers.md``: 32 prompts of 20-200 tokens,
  128 output tokens, all 32 in flight) for float32, bfloat16 and W8A8, interleaved rounds.

One result line per configuration, a JSON record in benchmarks/results/quantization.json
and a plot of tokens/s against batch size (quantization.png).

    .venv/bin/python benchmarks/quantization.py [--batches 1 4 16 64 128] [--rounds 2] [--peers]
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from pathlib import Path

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

from bf16_accuracy import QUESTIONS, last_logits
from common import REPO_ROOT, RESULTS_DIR, plot_path, write_result
from pagedllm import LLM, SamplingParams

# name -> (LLM keyword arguments, what it is)
CONFIGS: dict[str, dict] = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int8": dict(dtype="float32", quantization="int8"),
    "w8a8": dict(dtype="float32", quantization="w8a8"),
    "int4": dict(dtype="float32", quantization="int4"),
    "gguf-q4_1": dict(dtype="float32", quantization="gguf"),
    "gguf-q4_1+bf16": dict(dtype="bfloat16", quantization="gguf"),
    "kv-bfloat16": dict(dtype="float32", kv_cache_dtype="bfloat16"),
    "kv-fp8": dict(dtype="float32", kv_cache_dtype="fp8"),
    "kv-int8": dict(dtype="float32", kv_cache_dtype="int8"),
    "w8a8+kv-int8": dict(dtype="float32", quantization="w8a8", kv_cache_dtype="int8"),
    "int4+kv-int8": dict(dtype="float32", quantization="int4", kv_cache_dtype="int8"),
    "gguf-q4_1+kv-int8": dict(dtype="float32", quantization="gguf", kv_cache_dtype="int8"),
}
WEIGHT_CONFIGS = ["float32", "bfloat16", "int8", "w8a8", "int4", "gguf-q4_1", "gguf-q4_1+bf16"]
KV_CONFIGS = {"auto (float32)": "float32", "bfloat16": "kv-bfloat16", "fp8": "kv-fp8", "int8": "kv-int8"}
TEXT = Path(__file__).resolve().parent / "data" / "apache-2.0.txt"
SHORT_TEXT = REPO_ROOT / "tests" / "data" / "perplexity_text.txt"
PEERS_CONFIGS = ["float32", "bfloat16", "w8a8"]
CONTEXT = 2048


def make_llm(name: str, kv_memory: str) -> LLM:
    return LLM(max_model_len=2560, kv_cache_memory=kv_memory, max_num_seqs=256, **CONFIGS[name])


def packed_copy_bytes(llm: LLM) -> int:
    """Bytes of the packed copies (oneDNN or skinny GEMM) float projections keep beside their weights."""
    model = llm.llm_engine.runner.model
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if getattr(m, "is_packed", False))


def sizes(llm: LLM) -> dict:
    runner, spec = llm.llm_engine.runner, llm.llm_engine.kv_cache_spec
    return {"weight_bytes": runner.weight_bytes(), "onednn_packed_copy_bytes": packed_copy_bytes(llm),
            "kv_bytes_per_token": spec.bytes_per_block // spec.block_size}


def throughput(llm: LLM, convs: list, batch: int, max_tokens: int) -> float:
    """Output tokens/s of one generate call over ``batch`` chat prompts (prefill included)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch_convs = [convs[i % len(convs)] for i in range(batch)]
    t0 = time.perf_counter()
    outs = llm.chat(batch_convs, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def perplexity(llm: LLM, text_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of the text's tokens 2.. under the model."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": text_ids}], params, use_tqdm=False)[0]
    nll = [-entry[tok].logprob for tok, entry in zip(text_ids[1:], out.prompt_logprobs[1:])]
    return math.exp(sum(nll) / len(nll))


def accuracy_run(llm: LLM, convs: list, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.chat(convs, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logits = last_logits(llm, [o.prompt_token_ids for o in outs])
    tokenizer = llm.get_tokenizer()
    return {"tokens": tokens, "logits": logits,
            "perplexity": perplexity(llm, tokenizer(TEXT.read_text())["input_ids"]),
            "perplexity_short_text": perplexity(llm, tokenizer(SHORT_TEXT.read_text())["input_ids"])}


def peers_throughput(llm: LLM, workload) -> float:
    """Output tokens/s of the peers' workload, every request in flight at once (prefill included)."""
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def peers_run(rounds: int) -> dict:
    """Interleaved rounds of the peers' workload (fresh prompts each round: no prefix-cache hits); one
    engine at a time, loaded again each round (memory)."""
    from common import peers_workload, with_fresh_prompts

    base = peers_workload()
    tok_s: dict[str, list[float]] = {name: [] for name in PEERS_CONFIGS}
    for rnd in range(rounds):
        for name in PEERS_CONFIGS:
            llm = make_llm(name, "768MiB")  # 32 x 328 float32 KV tokens: no preemption
            throughput(llm, [[{"role": "user", "content": "Hi"}]], 2, 4)  # warm-up
            tok_s[name].append(peers_throughput(llm, with_fresh_prompts(base, rnd + 1)))
            print(f"peers round {rnd} {name}: {tok_s[name][-1]:.1f} output tok/s", flush=True)
            del llm
            gc.collect()
    median = {n: sorted(v)[len(v) // 2] for n, v in tok_s.items()}
    return {"workload": base.summary(), "tok_s_rounds": tok_s, "tok_s": median,
            "ratio_to_float32": {n: v / median["float32"] for n, v in median.items()}}


def agreement(ref: list[list[int]], alt: list[list[int]]) -> tuple[float, int]:
    """(share of positions before each prompt's first divergence, prompts identical)."""
    prefix = 0
    for a, b in zip(ref, alt):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += n
    return prefix / sum(map(len, ref)), sum(a == b for a, b in zip(ref, alt))


def users_table(results: dict, budget_bytes: int, context: int = CONTEXT) -> dict:
    """Sequences of ``context`` tokens that fit in ``budget_bytes`` for every weights x KV pair:
    (budget - weight bytes) // (KV bytes per token x context); ``context=1``: KV tokens that fit."""
    table = {}
    for w in (w for w in WEIGHT_CONFIGS if w in results):
        weight = results[w]["weight_bytes"]
        row = {}
        for kv_label, kv_name in KV_CONFIGS.items():
            if kv_name not in results:
                continue
            per_token = results[kv_name]["kv_bytes_per_token"]
            if w in ("bfloat16", "gguf-q4_1+bf16") and kv_label == "auto (float32)":
                per_token = results["bfloat16"]["kv_bytes_per_token"]  # auto = the model dtype
            row[kv_label] = max(0, (budget_bytes - weight) // (per_token * context))
        table[w] = row
    return table


def plot(results: dict, batches: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        ax.plot(batches, [r["tok_s"][str(b)] for b in batches], marker="o", label=name,
                linestyle="--" if "kv-" in name else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("SmolLM2-135M on CPU: throughput by weight format / KV dtype")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=2, help="throughput rounds over all configurations")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt for agreement")
    ap.add_argument("--output-tokens", type=int, default=32, help="new tokens per request in the throughput runs")
    ap.add_argument("--peers", action="store_true", help="also the peers' workload for float32, bfloat16, W8A8")
    ap.add_argument("--peers-rounds", type=int, default=2)
    ap.add_argument("--budget", default="1GiB", help="memory for weights + KV in the users-that-fit table")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--out", default=str(RESULTS_DIR / "quantization.json"))
    args = ap.parse_args()
    from pagedllm.config import parse_bytes

    torch.manual_seed(0)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    kv_memory = f"{max(256, 6 * max(args.batches))}MiB"  # every batch's KV fits: no preemption
    results: dict[str, dict] = {name: {"tok_s_rounds": {str(b): [] for b in args.batches}} for name in args.configs}
    runs = {}
    for rnd in range(args.rounds):
        for name in args.configs:
            llm = make_llm(name, kv_memory)
            if rnd == 0:
                results[name].update(sizes(llm))
                runs[name] = accuracy_run(llm, convs, args.max_tokens)
            throughput(llm, convs, 2, 4)  # warm-up
            for b in args.batches:
                results[name]["tok_s_rounds"][str(b)].append(throughput(llm, convs, b, args.output_tokens))
            del llm
            gc.collect()
    ref = runs.get("float32")
    for name, r in results.items():
        r["tok_s"] = {b: sorted(v)[len(v) // 2] for b, v in r["tok_s_rounds"].items()}
        r["perplexity"] = runs[name]["perplexity"]
        r["perplexity_short_text"] = runs[name]["perplexity_short_text"]
        if ref is not None:
            r["greedy_prefix_agreement"], r["prompts_identical"] = agreement(ref["tokens"], runs[name]["tokens"])
            r["max_abs_logit_diff"] = None if name.startswith("kv-") else \
                float((runs[name]["logits"] - ref["logits"]).abs().max())
        print(f"{name:>15}: weights {r['weight_bytes'] / 2**20:6.1f} MiB, KV {r['kv_bytes_per_token']} B/token, "
              f"tok/s " + " ".join(f"b{b}={v:.1f}" for b, v in r["tok_s"].items())
              + f", ppl {r['perplexity']:.3f}"
              + (f", greedy agreement {r['greedy_prefix_agreement']:.3f} ({r['prompts_identical']}/16 identical)"
                 if ref is not None else ""))
    record = {"model": "SmolLM2-135M-Instruct Q4_1 GGUF", "batches": args.batches, "rounds": args.rounds,
              "output_tokens_per_request": args.output_tokens, "greedy_tokens": args.max_tokens, "num_prompts": len(convs),
              "budget_bytes": parse_bytes(args.budget, "budget"), "context_tokens": CONTEXT,
              "configs": {n: {k: v for k, v in r.items()} for n, r in results.items()}}
    if "float32" in results:  # the configurations measured in this run
        record["users_that_fit"] = users_table(results, record["budget_bytes"])
        record["kv_tokens_that_fit"] = users_table(results, record["budget_bytes"], context=1)
    if "float32" in results:
        record["perplexity_vs_float32"] = {n: r["perplexity"] / results["float32"]["perplexity"]
                                           for n, r in results.items()}
        record["tok_s_vs_float32"] = {n: {b: v / results["float32"]["tok_s"][b] for b, v in r["tok_s"].items()}
                                      for n, r in results.items()}
    if args.peers:
        record["peers"] = peers_run(args.peers_rounds)
    out = write_result("quantization", record, args.out)
    plot(results, args.batches, plot_path(out))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
