"""Step-cost model: how much a prefill chunk adds to a decode step, on the real model.

With ``B`` requests decoding (context ``--context`` tokens each), times engine steps that
carry the B decodes plus a fresh prompt of ``P`` tokens (prefilled in that one step and
finished by it), against pure decode steps measured right before each mixed one. The
ratio mixed / decode is the factor by which one step with P prefill tokens stretches
every running stream's inter-token gap; the per-token slope is the marginal cost of a
prefill token. These figures chose the CPU default of
``EngineConfig.max_prefill_tokens_while_decoding`` and the starting shape of the online
step-cost model (``pagedllm.core.step_cost.DEFAULT_STEP_COST``) that the time-aware budget
(``max_step_time_ratio``) uses instead. One result line; JSON to
``benchmarks/results/step_cost.json``.

    .venv/bin/python benchmarks/step_cost.py
    .venv/bin/python benchmarks/step_cost.py --batches 48 --prefill-tokens 0,128,256 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import common

sys.path.insert(0, str(common.REPO_ROOT))


def timed_step(engine) -> float:
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,48", help="decode batch sizes B")
    p.add_argument("--prefill-tokens", default="32,64,128,256,512,2048", help="prefill chunk sizes P")
    p.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding request")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from pagedllm import LLM, SamplingParams

    batches = [int(x) for x in args.batches.split(",")]
    chunks = [int(x) for x in args.prefill_tokens.split(",")]
    budget = max(batches) + max(chunks)
    llm = LLM(dtype=args.dtype, max_model_len=4096, kv_cache_memory="2GiB", max_num_seqs=max(batches) + 2,
              max_num_batched_tokens=budget, max_prefill_tokens_while_decoding=budget, enable_prefix_caching=False)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    results = []
    for b in batches:
        decode_params = SamplingParams(temperature=0.0, max_tokens=1024, ignore_eos=True)
        ids = [engine.add_request(None, common.random_prompts(rng, np.array([args.context]))[0], decode_params)
               for _ in range(b)]
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        for _ in range(2):
            engine.step()  # warm
        for n in chunks:
            decode_s, mixed_s = [], []
            for _ in range(args.repeats):
                decode_s.append(timed_step(engine))
                engine.add_request(None, common.random_prompts(rng, np.array([n]))[0],
                                   SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
                mixed_s.append(timed_step(engine))
            d, m = statistics.median(decode_s), statistics.median(mixed_s)
            results.append({"decode_batch": b, "prefill_tokens": n, "decode_step_s": round(d, 4),
                            "mixed_step_s": round(m, 4), "ratio": round(m / d, 2),
                            "marginal_ms_per_prefill_token": round(1e3 * (m - d) / n, 3)})
            print(f"  B={b} P={n}: decode {d * 1e3:.0f} ms, mixed {m * 1e3:.0f} ms ({m / d:.2f}x)", file=sys.stderr)
        for rid in ids:
            engine.abort_request(rid)
        engine.step()
    record = {"dtype": args.dtype, "context": args.context, "repeats": args.repeats, "results": results}
    path = common.write_result("step_cost", record, args.out)
    slope = statistics.median(r["marginal_ms_per_prefill_token"] for r in results)
    print(f"step cost: a prefill token adds {slope:.2f} ms to a decode step (median over B, P); "
          + ", ".join(f"B={r['decode_batch']} P={r['prefill_tokens']} {r['ratio']:.1f}x" for r in results) + f" -> {path}")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
