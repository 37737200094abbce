"""Accuracy cost of bfloat16 against float32 on the real default model.

Runs the same 16 chat prompts greedily (64 new tokens) in float32 and bfloat16 and
reports: greedy token agreement (share of positions equal before the first divergence,
and prompts identical end to end), and the max |logit difference| on the prompts'
last-position logits. Fixed prompts, no sampling: deterministic. One result line and a
JSON record in benchmarks/results/bf16_accuracy.json. ``--candidate fp32-bf16-matmul`` measures
instead a float32 model whose linears compute in bfloat16 (``PAGEDLLM_CPU_FP32_MATMUL=bf16``).

    .venv/bin/python benchmarks/bf16_accuracy.py [--candidate fp32-bf16-matmul --out ...]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backend import set_forward_context

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain recursion briefly.",
    "List three primary colours.", "What is 12 times 7?", "Translate 'good morning' into Spanish.",
    "Give me a name for a pet turtle.", "Why is the sky blue?", "What does a CPU do?",
    "Name a famous painter.", "How do plants make food?", "What is the boiling point of water?",
    "Tell me a fun fact about cats.", "What is Python used for?", "Describe a rainbow.",
    "Suggest a healthy breakfast.",
]


def last_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """float32 logits [P, vocab] at each prompt's last position (one plain causal forward, no paged cache)."""
    runner = llm.llm_engine.runner
    out = []
    for ids in prompts:
        with torch.inference_mode(), set_forward_context(None):
            hidden = runner.model(torch.tensor(ids), torch.arange(len(ids)))
            out.append(runner.model.compute_logits(hidden[-1:]).float()[0])
    return torch.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--candidate", choices=["bfloat16", "fp32-bf16-matmul"], default="bfloat16")
    ap.add_argument("--out", default="benchmarks/results/bf16_accuracy.json")
    args = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    runs, logits = {}, {}
    for name in ("float32", args.candidate):
        dtype = name
        if name == "fp32-bf16-matmul":
            dtype, os.environ["PAGEDLLM_CPU_FP32_MATMUL"] = "float32", "bf16"
        llm = LLM(dtype=dtype, max_model_len=1024, kv_cache_memory="512MiB")
        os.environ.pop("PAGEDLLM_CPU_FP32_MATMUL", None)
        t0 = time.perf_counter()
        outs = llm.chat(convs, params, use_tqdm=False)
        runs[name] = ([o.outputs[0].token_ids for o in outs], time.perf_counter() - t0)
        logits[name] = last_logits(llm, [o.prompt_token_ids for o in outs])
        del llm
    ref, alt = runs["float32"][0], runs[args.candidate][0]
    prefix = [next((i for i, (a, b) in enumerate(zip(r, s)) if a != b), len(r)) for r, s in zip(ref, alt)]
    identical = sum(p == len(r) for p, r in zip(prefix, ref))
    agree = sum(prefix) / sum(len(r) for r in ref)
    max_diff = float((logits["float32"] - logits[args.candidate]).abs().max())
    top1 = float((logits["float32"].argmax(-1) == logits[args.candidate].argmax(-1)).float().mean())
    rec = {"candidate": args.candidate, "prompts": len(QUESTIONS), "max_tokens": args.max_tokens, "identical_prompts": identical,
           "token_agreement_before_first_divergence": agree, "first_divergence_steps": prefix,
           "max_abs_logit_diff_last_prompt_position": max_diff, "top1_agreement_last_prompt_position": top1,
           "seconds": {k: v[1] for k, v in runs.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=2))
    print(f"{args.candidate} vs fp32: {identical}/{len(QUESTIONS)} prompts identical over {args.max_tokens} greedy tokens, "
          f"{agree:.1%} of tokens before the first divergence, max |logit diff| {max_diff:.3f}, "
          f"top-1 agreement {top1:.0%}; time fp32 {runs['float32'][1]:.1f}s, {args.candidate} {runs[args.candidate][1]:.1f}s")


if __name__ == "__main__":
    main()
