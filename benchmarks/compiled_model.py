"""compilation_config=3 (torch.compile, inductor, freezing) against eager on the real default model.

Two engines in one process, the same weights: eager (the default) and compiled. Each puts
``--batch`` requests into decode (``--prompt-len`` token prompts), then the two take
alternate decode steps (``--steps`` each), so both see the same machine load: median wall
time and median process CPU time per step (``--threads 1``: CPU time is robust on a shared
machine). Also the compiled engine's start-up compile time.
With ``--accuracy``: the 16 chat prompts of bf16_accuracy.py run greedily (64 tokens) on
both engines: prompts identical end to end, share of tokens before the first divergence,
max |logprob difference| of the tokens both chose. One result line; JSON to
benchmarks/results/compiled_model_<dtype>.json.

    .venv/bin/python benchmarks/compiled_model.py --dtype float32 --accuracy
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

from bf16_accuracy import QUESTIONS  # the same 16 chat prompts as the bfloat16 accuracy check
from common import FIRST_ORDINARY_TOKEN_ID, machine_info, write_result
from pagedllm import LLM, SamplingParams


def fill_decode(llm: LLM, batch: int, prompt_len: int, max_tokens: int) -> None:
    """``batch`` random prompts prefilled: from here on every step is a pure decode step."""
    eng, rng = llm.llm_engine, random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(None, [rng.randrange(FIRST_ORDINARY_TOKEN_ID, 49000) for _ in range(prompt_len)], params)
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
    eng.step()


def alternate_steps(engines: dict[str, LLM], steps: int) -> dict[str, dict[str, float]]:
    """Median wall and process CPU seconds per decode step, engines taking turns step by step."""
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in engines}
    for _ in range(steps):
        for name, llm in engines.items():
            t, c = time.perf_counter(), time.process_time()
            llm.llm_engine.step()
            times[name]["wall"].append(time.perf_counter() - t)
            times[name]["cpu"].append(time.process_time() - c)
    return {name: {k: statistics.median(v) for k, v in kinds.items()} for name, kinds in times.items()}


def accuracy(engines: dict[str, LLM], max_tokens: int) -> dict:
    """Greedy agreement of the compiled engine with eager on the chat prompts."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    runs = {name: [o.outputs[0] for o in llm.chat(convs, params, use_tqdm=False)] for name, llm in engines.items()}
    ref, alt = runs["eager"], runs["compiled"]
    prefix = [next((i for i, (a, b) in enumerate(zip(r.token_ids, s.token_ids)) if a != b), len(r.token_ids))
              for r, s in zip(ref, alt)]
    diffs = [abs(r.logprobs[i][r.token_ids[i]].logprob - s.logprobs[i][s.token_ids[i]].logprob)
             for r, s, p in zip(ref, alt, prefix) for i in range(p)]
    return {"prompts": len(QUESTIONS), "max_tokens": max_tokens,
            "identical_prompts": sum(p == len(r.token_ids) for p, r in zip(prefix, ref)),
            "token_agreement_before_first_divergence": sum(prefix) / sum(len(r.token_ids) for r in ref),
            "first_divergence_steps": prefix, "max_abs_logprob_diff_of_chosen_tokens": max(diffs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for the whole run (compiled graphs are specialised to the thread count)")
    ap.add_argument("--compilation-config", default="3")
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    common = dict(dtype=args.dtype, max_model_len=1024, kv_cache_memory="512MiB", max_num_seqs=max(args.batch, 8))
    engines = {"eager": LLM(**common)}
    t0 = time.perf_counter()
    engines["compiled"] = LLM(compilation_config=args.compilation_config, **common)
    startup = time.perf_counter() - t0
    compiled = engines["compiled"].llm_engine.runner.compiled_model
    rec = {"dtype": args.dtype, "batch": args.batch, "prompt_len": args.prompt_len,
           "compilation_config": args.compilation_config, "compile_s": compiled.compile_seconds,
           "compiled_engine_startup_s": startup}
    if args.accuracy:
        rec["accuracy"] = accuracy(engines, 64)
    total = 2 + args.steps + 4
    for llm in engines.values():
        fill_decode(llm, args.batch, args.prompt_len, total)
    alternate_steps(engines, 2)  # warm-up
    t = alternate_steps(engines, args.steps)
    wall = {k: v["wall"] for k, v in t.items()}
    cpu = {k: v["cpu"] for k, v in t.items()}
    rec.update({"torch_threads": torch.get_num_threads(),
                "step_wall_ms": {k: v * 1e3 for k, v in wall.items()},
                "speedup_wall": wall["eager"] / wall["compiled"],
                "step_process_cpu_ms": {k: v * 1e3 for k, v in cpu.items()},
                "speedup_process_cpu": cpu["eager"] / cpu["compiled"],
                "eager_fallback_steps": compiled.num_eager_fallbacks})
    write_result(f"compiled_model_{args.dtype}", rec, args.out)
    acc = rec.get("accuracy")
    print(f"compiled vs eager ({args.dtype}, decode batch {args.batch}): step {wall['eager'] * 1e3:.1f} -> "
          f"{wall['compiled'] * 1e3:.1f} ms wall ({rec['speedup_wall']:.2f}x), process CPU "
          f"{cpu['eager'] * 1e3:.1f} -> {cpu['compiled'] * 1e3:.1f} ms ({rec['speedup_process_cpu']:.2f}x) at "
          f"{torch.get_num_threads()} torch threads; eager fallbacks {compiled.num_eager_fallbacks}; "
          f"compile {compiled.compile_seconds:.0f} s"
          + (f"; greedy {acc['identical_prompts']}/{acc['prompts']} prompts identical, "
             f"{acc['token_agreement_before_first_divergence']:.1%} tokens before divergence, max |dlogprob| "
             f"{acc['max_abs_logprob_diff_of_chosen_tokens']:.2e}" if acc else "")
          + f"; load {machine_info()['load_average_1_5_15min']}")


if __name__ == "__main__":
    main()
