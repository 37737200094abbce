"""Decode steps and prefills with the fused CPU kernels (pagedllm/ops) against the torch code they replace.

One process, one model (SmolLM2 by default): ``--batch`` requests are prefilled, then rounds of
``--steps`` decode steps alternate between the kernels on and off (``pagedllm.ops.set_enabled``),
so both paths see the same machine load; then ``--prefills`` prefills of a fresh
``--prefill-len``-token prompt (one request, one step up to the token budget; prefix caching is
off) alternate the same way. Reported per path: the median step wall time and the median
process CPU time per step (CPU time does not grow when another process takes the core), and
the on/off ratios; and how many greedy generations agree token for token between the paths (all
of them expected in float32; bfloat16 may flip a near-tie where a value rounds the other way).
One result line; JSON to benchmarks/results/fused_ops_<dtype>.json.

    .venv/bin/python benchmarks/fused_ops.py --dtype float32
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import common

from pagedllm import LLM, SamplingParams
from pagedllm.ops import set_enabled

PATHS = {"fused": True, "torch": False}


def timed_step(eng) -> tuple[float, float]:
    """(wall s, process CPU s) of one engine step."""
    w, c = time.perf_counter(), time.process_time()
    eng.step()
    return time.perf_counter() - w, time.process_time() - c


def decode_rounds(eng, rounds: int, steps: int) -> dict[str, dict[str, list[float]]]:
    """Alternate ``steps`` decode steps per path for ``rounds`` rounds; every step's wall and CPU time."""
    times = {p: {"wall": [], "cpu": []} for p in PATHS}
    for _ in range(rounds):
        for path, enabled in PATHS.items():
            set_enabled(enabled)
            eng.step()  # the first step after a switch is not timed
            for _ in range(steps):
                wall, cpu = timed_step(eng)
                times[path]["wall"].append(wall)
                times[path]["cpu"].append(cpu)
    set_enabled(None)
    return times


def prefill_rounds(eng, rounds: int, prompt_len: int, rng: random.Random) -> dict[str, dict[str, list[float]]]:
    """Alternate one whole prefill (fresh prompt, one output token) per path; wall and CPU time of each."""
    times = {p: {"wall": [], "cpu": []} for p in PATHS}
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(rounds):
        for path, enabled in PATHS.items():
            set_enabled(enabled)
            eng.add_request(None, [rng.randrange(common.FIRST_ORDINARY_TOKEN_ID, common.SMOLLM2_VOCAB_SIZE)
                                   for _ in range(prompt_len)], params)
            wall, cpu = 0.0, 0.0
            while eng.has_unfinished_requests():
                w, c = timed_step(eng)
                wall, cpu = wall + w, cpu + c
            times[path]["wall"].append(wall)
            times[path]["cpu"].append(cpu)
    set_enabled(None)
    return times


def greedy_agreement(llm, num_prompts: int, rng: random.Random) -> dict:
    """A short greedy generation on both paths: the fraction of requests whose tokens are all equal,
    and the mean length of the common prefix (tokens) over ``max_tokens``."""
    prompts = [[rng.randrange(common.FIRST_ORDINARY_TOKEN_ID, common.SMOLLM2_VOCAB_SIZE) for _ in range(40)]
               for _ in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for path, enabled in PATHS.items():
        set_enabled(enabled)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[path] = [list(o.outputs[0].token_ids) for o in outs]
    set_enabled(None)
    prefixes = [next((i for i, (a, b) in enumerate(zip(f, t)) if a != b), len(f))
                for f, t in zip(tokens["fused"], tokens["torch"])]
    return {"requests_equal": sum(f == t for f, t in zip(tokens["fused"], tokens["torch"])) / num_prompts,
            "mean_common_prefix": statistics.mean(prefixes), "max_tokens": params.max_tokens}


def summary(times: dict[str, dict[str, list[float]]]) -> dict:
    med = {p: {k: statistics.median(v) for k, v in t.items()} for p, t in times.items()}
    return {"median_s": med, "fused_over_torch": {k: med["fused"][k] / med["torch"][k] for k in ("wall", "cpu")},
            "num_samples": len(times["fused"]["wall"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5, help="decode steps per path per round")
    ap.add_argument("--prefills", type=int, default=3, help="prefills per path")
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    llm = LLM(dtype=args.dtype, max_model_len=4096, kv_cache_memory="2GiB", max_num_seqs=max(args.batch, 8),
              enable_prefix_caching=False, max_num_batched_tokens=max(args.prefill_len, 2048))
    eng = llm.llm_engine
    agree = greedy_agreement(llm, 8, rng)
    params = SamplingParams(temperature=0, max_tokens=2 * args.rounds * (args.steps + 1) + 4, ignore_eos=True)
    for _ in range(args.batch):
        eng.add_request(None, [rng.randrange(common.FIRST_ORDINARY_TOKEN_ID, common.SMOLLM2_VOCAB_SIZE)
                               for _ in range(args.prompt_len)], params)
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()  # prefill everything; from here on every step is a pure decode step
    decode = summary(decode_rounds(eng, args.rounds, args.steps))
    while eng.has_unfinished_requests():
        eng.step()
    prefill = summary(prefill_rounds(eng, args.prefills, args.prefill_len, rng))
    record = {"dtype": args.dtype, "batch": args.batch, "prompt_len": args.prompt_len,
              "prefill_len": args.prefill_len, "decode_step": decode, "prefill": prefill,
              "greedy_fused_vs_torch": agree}
    path = common.write_result(f"fused_ops_{args.dtype}", record, args.out)
    d, p = decode["fused_over_torch"], prefill["fused_over_torch"]
    print(f"fused CPU ops ({args.dtype}): decode step at batch {args.batch} "
          f"{decode['median_s']['fused']['wall'] * 1e3:.1f} vs {decode['median_s']['torch']['wall'] * 1e3:.1f} ms "
          f"(wall x{d['wall']:.3f}, CPU x{d['cpu']:.3f}); prefill of {args.prefill_len} tokens "
          f"{prefill['median_s']['fused']['wall']:.2f} vs {prefill['median_s']['torch']['wall']:.2f} s "
          f"(wall x{p['wall']:.3f}, CPU x{p['cpu']:.3f}); greedy requests equal fused vs torch: "
          f"{agree['requests_equal']:.0%}; -> {path}")


if __name__ == "__main__":
    main()
