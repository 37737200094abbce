"""Where the time of a saturated decode step goes, on the real model.

Puts ``--batch`` requests into decode (prompts prefilled first), then times
``--steps`` engine steps phase by phase — scheduler, input preparation, model forward,
logits + sampling (split into the lm_head matmul and the sampler proper), scheduler
update, detokenization/outputs — and, with torch's
profiler, splits the forward into matmuls, attention and the rest. "Python overhead"
is the step's wall time outside torch operators (host-side bookkeeping). One result
line; JSON to benchmarks/results/step_profile.json.

    .venv/bin/python benchmarks/step_profile.py --batch 64
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams


def wrap(obj, name: str, acc: dict, key: str) -> None:
    """Accumulate the wall time of ``obj.name(...)`` into ``acc[key]``."""
    fn = getattr(obj, name)

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] += time.perf_counter() - t

    setattr(obj, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="benchmarks/results/step_profile.json")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, max_model_len=1024, kv_cache_memory="2GiB", max_num_seqs=max(args.batch, 8))
    eng = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    for _ in range(args.batch):
        eng.add_request(None, [rng.randrange(3, 49000) for _ in range(args.prompt_len)], params)
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()  # prefill everything; from here on every step is a pure decode step
    eng.step()
    acc: dict[str, float] = defaultdict(float)
    runner = eng.runner
    wrap(eng.scheduler, "schedule", acc, "schedule")
    wrap(runner, "_update_states", acc, "input_prep")
    wrap(runner, "_order_batch", acc, "input_prep")
    wrap(runner, "_prepare_inputs", acc, "input_prep")
    wrap(runner.model, "forward", acc, "forward")
    backend = runner.model.model.layers[0].self_attn.attn.backend  # one backend object shared by all layers
    if hasattr(backend, "_decode"):
        wrap(backend, "_decode", acc, "forward.decode_attention")
    wrap(runner, "_sample", acc, "logits_and_sampling")
    wrap(runner.model, "compute_logits", acc, "logits_and_sampling.lm_head")
    wrap(runner.sampler, "forward", acc, "logits_and_sampling.sampler")
    wrap(eng.scheduler, "update_from_output", acc, "scheduler_update")
    wrap(eng.output_processor, "process", acc, "outputs_detokenize")
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    wall = (time.perf_counter() - t0) / args.steps
    per_step = {k: v / args.steps for k, v in acc.items()}
    # torch profiler over a few more steps: operator self time by kind
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            eng.step()
    kinds: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        n = evt.key
        kind = ("matmul" if any(s in n for s in ("linear", "addmm", "mm", "matmul")) else
                "attention" if any(s in n for s in ("attention", "index_select", "index_copy")) else
                "other_ops")
        if n.startswith("aten::") or "mkldnn" in n:
            kinds[kind] += evt.self_cpu_time_total / 1e6 / 4
    # the fused C decode kernel runs outside torch operators: count it as attention, not Python
    kinds["attention"] += per_step.get("forward.decode_attention", 0.0)
    op_total = sum(kinds.values())
    python = max(wall - op_total, 0.0)
    import os
    rec = {"load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()], "batch": args.batch, "dtype": args.dtype, "step_wall_s": wall, "phases_s": per_step,
           "op_time_by_kind_s": dict(kinds), "python_overhead_s": python,
           "python_overhead_fraction": python / wall, "tokens_per_s": args.batch / wall,
           "torch_threads": torch.get_num_threads()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=2))
    phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in per_step.items())
    ops = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in kinds.items())
    print(f"decode step at batch {args.batch} ({args.dtype}): {wall * 1e3:.1f} ms = {args.batch / wall:.0f} tok/s; "
          f"phases (ms): {phases}; operators (ms): {ops}; python overhead {python / wall:.1%}")


if __name__ == "__main__":
    main()
