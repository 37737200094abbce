"""The decode plan's effect on a decode step, both variants in one process (steady on a shared machine).

Puts ``--batch`` requests (random ``--prompt-len``-token prompts) of SmolLM2 into decode, then runs
the model forward of one decode step on one torch thread, alternating
``CpuPagedAttention.plan_decodes`` True and False (pagedllm/attention/decode_plan.py) from one
forward to the next, and takes each forward's thread CPU time: the real forward, then a floor where
every linear answers a cached output and every C kernel is a C no-op with the kernel's own ctypes
signature (the Python and the ctypes argument conversion remain, the compute does not). Medians.
One result line; JSON to benchmarks/results/decode_plan_<dtype>.json (or --out).

    .venv/bin/python benchmarks/decode_plan.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

import common
from decode_glue import decode_step_forward
from pagedllm.models.layers import linear as linear_module
from pagedllm.ops.library import cpu_ops

_OP_TABLES = ("rms_norm", "act_and_mul", "rope_qk", "rms_norm_call", "act_and_mul_call", "rope_qk_call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--iters", type=int, default=20, help="real forwards per variant")
    ap.add_argument("--floor-iters", type=int, default=200, help="floor forwards per variant")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm, forward = decode_step_forward(args.dtype, args.batch, args.prompt_len)
    model = llm.llm_engine.runner.model
    backend = model.model.layers[0].self_attn.attn.backend

    real = alternated(forward, backend, args.iters)
    stub_compute(model, backend)
    floor = alternated(forward, backend, args.floor_iters)
    rec = {"load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()], "dtype": args.dtype,
           "batch": args.batch, "prompt_len": args.prompt_len, "torch_threads": 1,
           "forward_ms_planned": real[True], "forward_ms_unplanned": real[False],
           "forward_ratio_planned_over_unplanned": real[True] / real[False],
           "floor_ms_planned": floor[True], "floor_ms_unplanned": floor[False],
           "floor_ratio_planned_over_unplanned": floor[True] / floor[False]}
    path = common.write_result(f"decode_plan_{args.dtype}", rec, args.out)
    print(f"decode forward at batch {args.batch} ({args.dtype}, 1 thread, CPU ms), planned vs unplanned: "
          f"{real[True]:.1f} vs {real[False]:.1f} ({rec['forward_ratio_planned_over_unplanned']:.3f}x); floor "
          f"{floor[True]:.2f} vs {floor[False]:.2f} ({rec['floor_ratio_planned_over_unplanned']:.3f}x) -> {path}")


def alternated(forward, backend, iters: int) -> dict[bool, float]:
    """Median thread CPU time (ms) of the forward with ``plan_decodes`` True and False, alternated
    (the order swapped every other round)."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for flag in (True, False):  # warm both paths
        backend.plan_decodes = flag
        forward()
    for i in range(iters):
        for flag in ((True, False) if i % 2 else (False, True)):
            backend.plan_decodes = flag
            t = time.thread_time()
            forward()
            times[flag].append(time.thread_time() - t)
    backend.plan_decodes = True
    return {flag: statistics.median(v) * 1e3 for flag, v in times.items()}


def stub_compute(model, backend) -> None:
    """Linears answer their first output again; every C kernel of the attention backend and of
    pagedllm/ops becomes a C no-op with the kernel's ctypes signature (returning 0)."""
    outputs: dict[int, torch.Tensor] = {}
    linear_forward = linear_module.Linear.forward

    def cached_linear(self, x):
        if id(self) not in outputs:
            outputs[id(self)] = linear_forward(self, x)
        return outputs[id(self)]

    linear_module.Linear.forward = cached_linear
    libc = ctypes.CDLL(None)

    def noop_like(fn):
        noop = libc["abs"]  # a fresh function object: its own argtypes
        noop.argtypes, noop.restype = fn.argtypes, None
        return lambda *a: (noop(*a), 0)[1]

    kernel, ops = backend.kernel, cpu_ops()
    tables = [kernel._fns, getattr(kernel, "call_fns", {})]
    tables += [getattr(ops, name) for name in _OP_TABLES if ops is not None and hasattr(ops, name)]
    for table in tables:
        for dtype, fn in list(table.items()):
            table[dtype] = noop_like(fn)


if __name__ == "__main__":
    main()
