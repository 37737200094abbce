"""Where the time of the served workload goes, step by step, in-process (no HTTP).

The workload of ``serving.py``'s peer comparison (N prompts of P random token ids, exactly O
greedy output tokens each, C in flight: a finished request is replaced at once) runs through
``LLMEngine`` with ``serve``'s CPU defaults (``EngineConfig.with_serving_defaults``; the prompt
token cap while decoding from ``--cap``). Every step is timed and classed by what it carried:
decode-only, mixed (decodes and prompt tokens) or prefill-only. Also measured in the same
process: a prefill-only step of ``budget / P`` whole prompts, the time per prompt token when
prompts ride alone in full steps, and a decode-only step at batch C.

What it answers: how much of the run is prompt work at the matmul rate (nothing a scheduler can
shorten), and how many decode passes the schedule needed against the N / C × O that C streams
need at least. One line and a JSON record.

    .venv/bin/python benchmarks/served_steps.py --out benchmarks/results/served_steps.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import common
import numpy as np
import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random ordinary token ids (a new ``seed``, no prefix-cache hit)."""
    return common.random_prompts(np.random.default_rng(seed), np.full(n, length))


def unfinished_prompts(engine: LLMEngine) -> set[str]:
    """Ids of the requests whose prompt is not fully computed yet (waiting ones included): what they
    get scheduled this step is prompt work, whatever its size (a recompute after preemption too)."""
    sched = engine.scheduler
    return {r.request_id for r in [*sched.waiting, *sched.running]
            if r.num_computed_tokens < len(r.prompt_token_ids)}


def run_workload(engine: LLMEngine, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    """The served workload through ``engine.step()``, ``concurrency`` requests in flight (a finished
    one replaced at once). Returns ``duration_s`` (seconds), ``output_tok_s``, ``steps`` (per kind
    decode / mixed / prefill: ``steps``, ``seconds``, ``prompt_tokens``, ``decode_tokens``),
    ``decode_passes`` (steps that decoded) and ``min_decode_passes``: the fewest steps that can hold
    the workload's N·(O−1) decodes (the first token of each comes from its prefill) at
    ``concurrency`` per step."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.scheduler.step_trace = []
    kinds = {k: {"steps": 0, "seconds": 0.0, "prompt_tokens": 0, "decode_tokens": 0}
             for k in ("decode", "mixed", "prefill")}
    added, in_flight = 0, 0
    start = time.perf_counter()
    while added < len(prompts) or engine.has_unfinished_requests():
        while in_flight < concurrency and added < len(prompts):
            engine.add_request(f"w{added}", {"prompt_token_ids": prompts[added]}, params)
            added, in_flight = added + 1, in_flight + 1
        prefilling = unfinished_prompts(engine)
        t0 = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - t0
        in_flight -= sum(o.finished for o in outputs)
        scheduled = engine.scheduler.step_trace[-1]
        prompt = sum(n for rid, n in scheduled.items() if rid in prefilling)
        decode = sum(n for rid, n in scheduled.items() if rid not in prefilling)
        kind = kinds["decode" if not prompt else "prefill" if not decode else "mixed"]
        kind["steps"] += 1
        kind["seconds"] += seconds
        kind["prompt_tokens"] += prompt
        kind["decode_tokens"] += decode
    duration = time.perf_counter() - start
    engine.scheduler.step_trace = None
    output_tokens = len(prompts) * output_len
    return {"duration_s": round(duration, 2), "output_tok_s": round(output_tokens / duration, 1),
            "steps": {k: {**v, "seconds": round(v["seconds"], 2)} for k, v in kinds.items()},
            "decode_passes": kinds["decode"]["steps"] + kinds["mixed"]["steps"],
            "min_decode_passes": -(-len(prompts) * (output_len - 1) // concurrency)}


def time_prefill_step(engine: LLMEngine, num_prompts: int, length: int, repeats: int, seed: int) -> float:
    """Median seconds per prompt token of one step holding ``num_prompts`` new prompts of ``length``
    tokens (one output token each; fresh ids every repeat, so no prefix-cache hit)."""
    per_token = []
    for r in range(repeats):
        prompts = random_prompts(num_prompts, length, seed + r)
        for i, p in enumerate(prompts):
            engine.add_request(f"p{r}-{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        engine.step()
        per_token.append((time.perf_counter() - t0) / sum(map(len, prompts)))
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(per_token)


def time_decode_step(engine: LLMEngine, prompts: list[list[int]], steps: int) -> float:
    """Median seconds of a decode-only step with ``len(prompts)`` sequences (contexts: their prompt
    lengths and up to ``steps`` more tokens; the first two steps, which capture the CPU decode
    graphs, are left out)."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", {"prompt_token_ids": p}, params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> dict:
    """Run the workload ``--repeats`` times and the two reference steps; write the JSON record
    (``benchmarks/results/served_steps.json`` unless ``--out``) and return it."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--cap", type=int, default=None, help="prompt tokens per step while decoding (default: serve's)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    config = EngineConfig(model="smollm2-135m-instruct", max_model_len=2048).with_serving_defaults("cpu")
    if args.cap is not None:
        config = config.replace(max_prefill_tokens_while_decoding=args.cap)
    engine = LLMEngine(config)
    per_step = max(1, config.token_budget // args.input_len)
    # warm-up: a prefill step and decode steps at the workload's batch (the CPU decode graphs' capture)
    time_prefill_step(engine, per_step, args.input_len, 1, seed=100)
    time_decode_step(engine, random_prompts(args.concurrency, args.input_len, seed=101), 4)
    # fresh prompt ids for every run: a repeat must not hit the prefix cache
    runs = [run_workload(engine, random_prompts(args.num_prompts, args.input_len, seed=r), args.output_len,
                         args.concurrency) for r in range(args.repeats)]
    prefill_s_per_token = time_prefill_step(engine, per_step, args.input_len, 3, seed=200)
    # decode steps at the workload's mean context: prompts of input_len + output_len / 2 tokens
    decode_step_s = time_decode_step(
        engine, random_prompts(args.concurrency, args.input_len + args.output_len // 2, seed=300), 12)
    prompt_tokens = args.num_prompts * args.input_len
    result = {
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "concurrency": args.concurrency},
        "max_prefill_tokens_while_decoding": config.max_prefill_tokens_while_decoding,
        "token_budget": config.token_budget, "runs": runs,
        "prefill_step_ms_per_prompt_token": round(prefill_s_per_token * 1e3, 3),
        "prefill_step_prompts": per_step,
        "decode_step_ms_at_concurrency": round(decode_step_s * 1e3, 1),
        # what the prompt tokens cost alone at the full-step rate, and the fewest decode steps C streams need
        "prompt_work_s": round(prompt_tokens * prefill_s_per_token, 2),
        "min_decode_passes_s": round(runs[0]["min_decode_passes"] * decode_step_s, 2),
    }
    common.write_result("served_steps", result, args.out)
    durations = [r["duration_s"] for r in runs]
    print(f"served steps: {statistics.median(durations):.1f} s ({[r['output_tok_s'] for r in runs]} out tok/s); "
          f"prompt work alone {result['prompt_work_s']} s at {result['prefill_step_ms_per_prompt_token']} ms/token, "
          f"{runs[0]['min_decode_passes']} decode steps at batch {args.concurrency} "
          f"{result['min_decode_passes_s']} s; decode passes {[r['decode_passes'] for r in runs]}")
    return result


if __name__ == "__main__":
    main()
