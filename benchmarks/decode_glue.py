"""The decode step's forward outside its compute kernels ("glue"), measured without a profiler.

Puts 32 requests (random 160-token prompts) of SmolLM2 into decode, then runs the model forward
of one decode step repeatedly on one torch thread and takes the thread's CPU time (robust on a
shared machine): the whole forward, the time inside the linear layers, the fused C kernels of
pagedllm/ops and the attention kernel's calls, and the rest ("glue": Python, module calls,
argument checks, small torch ops). Then the same forward with every linear answering a cached
output and every C kernel a no-op: the glue's floor with warm caches (interleaved with the real
kernels, the same Python runs several times slower, its data evicted by the matmuls). Medians
over the iterations. One result line; JSON to benchmarks/results/decode_glue_<dtype>.json (or --out).

    .venv/bin/python benchmarks/decode_glue.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

import common
from pagedllm import LLM, SamplingParams
from pagedllm.attention import set_forward_context
from pagedllm.models.layers import linear as linear_module
from pagedllm.ops.library import cpu_ops


def timed(fn, acc: dict, key: str):
    """fn, adding its thread CPU time to acc[key]."""
    def wrapper(*a, **kw):
        t = time.thread_time()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] += time.thread_time() - t
    return wrapper


def decode_step_forward(dtype: str, batch: int, prompt_len: int) -> tuple[LLM, object]:
    """SmolLM2 with ``batch`` requests of ``prompt_len`` random tokens prefilled and one token
    decoded; returns the LLM and ``forward()``, which reruns the model on the next pure decode
    step's inputs (the same inputs every call: the KV cache is rewritten in place, not grown)."""
    llm = LLM(dtype=dtype, max_model_len=1024, kv_cache_memory="1GiB", max_num_seqs=batch)
    eng, rng = llm.llm_engine, random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(None, [rng.randrange(common.FIRST_ORDINARY_TOKEN_ID, 49000) for _ in range(prompt_len)],
                        params)
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
    eng.step()
    runner, model = eng.runner, eng.runner.model
    step = runner._order_batch(eng.scheduler.schedule())  # a pure decode step's inputs, reused
    input_ids, positions, metas, _ = runner._prepare_inputs(step)

    def forward():
        with torch.inference_mode(), set_forward_context(metas):
            return model(input_ids, positions)
    return llm, forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm, forward = decode_step_forward(args.dtype, args.batch, args.prompt_len)
    model = llm.llm_engine.runner.model

    acc: dict[str, float] = defaultdict(float)
    kernel, ops = model.model.layers[0].self_attn.attn.backend.kernel, cpu_ops()
    for name in ("decode", "prefill", "write"):
        if hasattr(kernel, name):
            setattr(kernel, name, timed(getattr(kernel, name), acc, "attention_kernel"))
    for dtype, fn in getattr(kernel, "call_fns", {}).items():  # the decode plan's one-struct calls
        kernel.call_fns[dtype] = timed(fn, acc, "attention_kernel")
    for table in op_tables(ops):
        for dtype, fn in table.items():
            table[dtype] = timed(fn, acc, "fused_ops")
    linear_forward = linear_module.Linear.forward
    linear_module.Linear.forward = timed(linear_forward, acc, "linear")
    totals, parts = measure(forward, args.iters, acc)
    glue = [t - sum(parts[k][i] for k in parts) for i, t in enumerate(totals)]
    rec = {"load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()], "dtype": args.dtype, "batch": args.batch, "prompt_len": args.prompt_len,
           "torch_threads": 1, "forward_ms": statistics.median(totals) * 1e3,
           **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in parts.items()},
           "glue_ms": statistics.median(glue) * 1e3,
           "stubbed_forward_ms": stubbed_forward_ms(forward, args.iters * 3, linear_forward, kernel, ops)}
    rec["glue_fraction_of_forward"] = rec["glue_ms"] / rec["forward_ms"]
    path = common.write_result(f"decode_glue_{args.dtype}", rec, args.out)
    print(f"decode forward at batch {args.batch} ({args.dtype}, 1 thread, CPU ms): {rec['forward_ms']:.1f}, glue "
          f"{rec['glue_ms']:.1f} ({rec['glue_fraction_of_forward']:.1%}), floor {rec['stubbed_forward_ms']:.2f} -> {path}")


def op_tables(ops) -> list[dict]:
    """The fused kernels' ctypes functions by dtype, argument-list and struct-argument forms alike."""
    names = ("rms_norm", "act_and_mul", "rope_qk", "rms_norm_call", "act_and_mul_call", "rope_qk_call")
    return [getattr(ops, name) for name in names if hasattr(ops, name)] if ops is not None else []


def measure(forward, iters: int, acc: dict) -> tuple[list[float], dict[str, list[float]]]:
    """Thread CPU time of each forward, and of each wrapped part within it."""
    for _ in range(3):
        forward()
    totals, parts = [], defaultdict(list)
    for _ in range(iters):
        acc.clear()
        t = time.thread_time()
        forward()
        totals.append(time.thread_time() - t)
        for k, v in acc.items():
            parts[k].append(v)
    return totals, parts


def stubbed_forward_ms(forward, iters: int, linear_forward, kernel, ops) -> float:
    """Median thread CPU time (ms) of the forward with cached linear outputs and no-op C kernels."""
    outputs: dict[int, torch.Tensor] = {}

    def cached_linear(self, x):
        if id(self) not in outputs:
            outputs[id(self)] = linear_forward(self, x)
        return outputs[id(self)]

    linear_module.Linear.forward = cached_linear
    for name in ("decode", "prefill", "write"):
        if hasattr(kernel, name):
            setattr(kernel, name, lambda *a, **kw: None)
    for dtype in getattr(kernel, "call_fns", {}):
        kernel.call_fns[dtype] = lambda *a: 0
    for table in op_tables(ops):
        for dtype in table:
            table[dtype] = lambda *a: None
    try:
        totals, _ = measure(forward, iters, defaultdict(float))
    finally:
        linear_module.Linear.forward = linear_forward
    return statistics.median(totals) * 1e3


if __name__ == "__main__":
    main()
