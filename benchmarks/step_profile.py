"""Where the time of a saturated decode step goes, on the real model.

Puts ``--batch`` requests into decode (prompts prefilled first), then times
``--steps`` engine steps phase by phase — scheduler, input preparation, model forward,
logits + sampling (split into the lm_head matmul and the sampler proper), scheduler
update, detokenization/outputs — and, with torch's
profiler, splits the forward into matmuls, attention and the rest. "Python overhead"
is the step's wall time outside torch operators and the C decode kernel (host-side
bookkeeping), measured within each profiled step. Figures are medians over steps (a shared
machine makes some steps outliers). ``fractions_of_step`` states the shares the issue's
targets are about: Python overhead, the lm_head matmul, and logits processing + sampling
(everything of the runner's ``_sample`` but the lm_head). One result line; JSON to
benchmarks/results/step_profile.json.

    .venv/bin/python benchmarks/step_profile.py --batch 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

from pagedllm import LLM, SamplingParams, envs
from pagedllm.models.layers import attention as attention_module
from pagedllm.models.layers import activation as activation_module
from pagedllm.models.layers import norm as norm_module
from pagedllm.ops import skinny_gemm


def wrap(obj, name: str, acc: dict, key: str, clock=time.perf_counter, depth: list[int] | None = None) -> None:
    """Accumulate the ``clock`` time (default: wall) of ``obj.name(...)`` into ``acc[key]``;
    ``depth[0]`` (if given) counts the calls in progress."""
    fn = getattr(obj, name)

    def timed(*a, **kw):
        t = clock()
        if depth is not None:
            depth[0] += 1
        try:
            return fn(*a, **kw)
        finally:
            acc[key] += clock() - t
            if depth is not None:
                depth[0] -= 1

    setattr(obj, name, timed)


# Every entry point of the skinny GEMM library, each timed as a C kernel (gemm_bf16_dp_f32out is the
# bfloat16 LM head's: left out, its time would count as Python; test_benchmarks checks the list).
SKINNY_KERNELS = ("gemm_f32", "gemm_bf16_amx", "gemm_bf16_dp", "gemm_bf16_dp_f32out")
NATIVE_REPLAY = envs.CPU_GRAPH_NATIVE_REPLAY.name  # the timed steps replay from Python (cpu_time_breakdown)


def cpu_time_breakdown(eng, num_steps: int) -> dict[str, float]:
    """Process CPU time (ms) per decode step and per part, with one torch thread.

    CPU time does not grow when another process takes the core, so on a shared machine
    these shares hold where wall-clock shares do not. Parts (nested parts are also inside
    their parents): linear layers (lm_head included), RMSNorm (with its residual add), the
    rotary embedding (torch code or fused kernel), the fused activation-and-multiply kernel,
    attention (K/V write + decode kernel), and ``_sample`` (lm_head included).

    ``c_kernels`` is the time inside the C kernels proper (the ctypes calls of pagedllm/ops, of
    the skinny GEMM and of the attention kernel, without their Python wrappers); ``linear`` is the
    time of the linear layers outside the skinny GEMM (oneDNN, ``F.linear``, and ``Linear.forward``'s
    own Python, so eager steps' outside figure leaves that Python out); ``outside_compute`` is the
    step minus ``linear`` minus ``c_kernels``: Python (engine, model glue, kernel wrappers) and the
    small torch ops, measured without a profiler (the profiler's per-op cost inflates its own
    "Python overhead" figure). ``outside_compute_fraction`` is its share of the step.

    The CPU decode graphs (pagedllm/worker/cpu_graph.py) replay the kernel calls they recorded, so
    they are dropped once the timers are in place: the timed steps replay graphs recorded with the
    timed kernels (two untimed steps first: one eager, one captured), from Python
    (``PAGEDLLM_CPU_GRAPH_NATIVE_REPLAY=0`` meanwhile: the native replay calls the C code past the timers).
    """
    from pagedllm.models.layers.linear import Linear
    from pagedllm.models.layers.norm import RMSNorm
    from pagedllm.models.layers.rotary import RotaryEmbedding

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    native_replay = os.environ.get(NATIVE_REPLAY)
    os.environ[NATIVE_REPLAY] = "0"
    acc: dict[str, float] = defaultdict(float)
    clock = time.process_time
    layer = eng.runner.model.model.layers[0]
    parts = [(Linear, "forward", "linear"), (RMSNorm, "forward", "rms_norm"),
             (type(layer.self_attn.attn.impl), "forward", "attention"), (eng.runner, "_sample", "sample")]
    kernel = getattr(layer.self_attn.attn.backend, "kernel", None)
    parts += [(kernel, name, "c_kernels") for name in ("decode", "prefill", "write") if hasattr(kernel, name)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in parts]
    from pagedllm.ops.library import cpu_ops
    ops = cpu_ops()
    # Kernel-level timers: every C call counts in c_kernels; one made while its part's Python
    # wrapper is not running (a replayed CPU decode graph) counts in that part too.
    depth = {"linear": [0], "rms_norm": [0], "rotary": [0], "act_and_mul": [0], "attention": [0]}
    op_parts = {"rms_norm": "rms_norm", "act_and_mul": "act_and_mul", "rope_qk": "rotary",
                "rms_norm_call": "rms_norm", "act_and_mul_call": "act_and_mul", "rope_qk_call": "rotary"}
    op_tables = [(getattr(ops, name), part) for name, part in op_parts.items() if hasattr(ops, name)] if ops else []
    if hasattr(kernel, "call_fns"):
        op_tables.append((kernel.call_fns, "attention"))  # the decode plan's one-struct calls
    skinny = skinny_gemm._get_kernel() if skinny_gemm.enabled() else None
    saved_tables = [(table, dict(table)) for table, _ in op_tables]
    for table, part in op_tables:
        for key, fn in table.items():
            table[key] = _cpu_timed(fn, acc, "c_kernels", part=(part, depth[part]))
    if skinny is not None:  # its gemm_* kernels: their own part, taken out of "linear"
        saved_tables.append((skinny.__dict__, dict(skinny.__dict__)))
        for key in SKINNY_KERNELS:
            setattr(skinny, key, _cpu_timed(_cpu_timed(getattr(skinny, key), acc, "skinny_gemm"), acc, "c_kernels",
                                            part=("skinny_in_linear", [1]), inside=depth["linear"]))
    rotary_apply = RotaryEmbedding.apply
    rope_qk, act_and_mul = attention_module.rope_qk, activation_module.act_and_mul
    try:
        for obj, name, key in parts:
            wrap(obj, name, acc, key, clock, depth=depth.get(key))
        RotaryEmbedding.apply = staticmethod(_cpu_timed(rotary_apply, acc, "rotary", depth=depth["rotary"]))
        # the fused kernel (pagedllm/ops)
        attention_module.rope_qk = _cpu_timed(rope_qk, acc, "rotary", depth=depth["rotary"])
        activation_module.act_and_mul = _cpu_timed(act_and_mul, acc, "act_and_mul", depth=depth["act_and_mul"])
        # One untimed step first: oneDNN keys its primitives by thread count, so the first step on
        # one thread creates (JIT-compiles) every bfloat16 linear's primitive again.
        graphs = eng.runner.cpu_graphs
        if graphs is not None:
            graphs.clear()
            eng.step()  # eager: the size's first step
        eng.step()
        acc.clear()
        total = 0.0
        for _ in range(num_steps):
            t = clock()
            eng.step()
            total += clock() - t
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        RotaryEmbedding.apply = staticmethod(rotary_apply)
        attention_module.rope_qk, activation_module.act_and_mul = rope_qk, act_and_mul
        for table, fns in saved_tables:
            table.update(fns)
        torch.set_num_threads(threads)
        if native_replay is None:
            os.environ.pop(NATIVE_REPLAY, None)
        else:
            os.environ[NATIVE_REPLAY] = native_replay
    acc["linear"] -= acc.pop("skinny_in_linear", 0.0)  # counted in c_kernels
    outside = total - acc["linear"] - acc["c_kernels"]
    replayed = graphs is not None and graphs.num_replayed > 0
    if graphs is not None:
        graphs.clear()  # the timers stay in the recorded calls otherwise
    return {"step": total / num_steps * 1e3, "cpu_graphs_replayed": replayed,
            **{k: v / num_steps * 1e3 for k, v in acc.items()},
            "outside_compute": outside / num_steps * 1e3, "outside_compute_fraction": outside / total}


def _cpu_timed(fn, acc: dict, key: str, clock=time.process_time, part: tuple[str, list[int]] | None = None,
               depth: list[int] | None = None, inside: list[int] | None = None):
    """fn, adding its ``clock`` time (default: process CPU time) to ``acc[key]``.

    ``part`` (name, its wrapper's depth): the time also goes to ``acc[name]`` while that depth is 0
    (no wrapper of the part is running, so it would not be counted there); with ``inside`` (a
    depth), only while ``inside[0] > 0``. ``depth[0]`` (if given) counts this fn's calls in progress.
    """
    def timed(*a, **kw):
        t = clock()
        if depth is not None:
            depth[0] += 1
        try:
            return fn(*a, **kw)
        finally:
            dt = clock() - t
            acc[key] += dt
            if depth is not None:
                depth[0] -= 1
            if part is not None and (inside[0] > 0 if inside is not None else part[1][0] == 0):
                acc[part[0]] += dt
    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=5, help="steps profiled one by one (Python overhead)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None, help="the engine's quantization (gguf, w8a8, ...)")
    ap.add_argument("--cpu-time-steps", type=int, default=0,
                    help="then this many steps with one torch thread, CPU time per part (robust on a shared machine)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no CPU decode graphs (pagedllm/worker/cpu_graph.py): every step runs the layers' Python")
    ap.add_argument("--out", default="benchmarks/results/step_profile.json")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, quantization=args.quantization, max_model_len=1024, kv_cache_memory="2GiB", max_num_seqs=max(args.batch, 8),
              enforce_eager=args.enforce_eager)
    eng = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + args.profile_steps + args.cpu_time_steps + 8, ignore_eos=True)
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
    attn = runner.model.model.layers[0].self_attn.attn
    backend = attn.backend  # one backend object shared by all layers
    if hasattr(attn.impl, "_decode"):
        wrap(type(attn.impl), "_decode", acc, "forward.decode_attention")
    call_fns = getattr(getattr(backend, "kernel", None), "call_fns", {})  # the decode plan's kernel calls
    for dtype, fn in call_fns.items():
        call_fns[dtype] = _cpu_timed(fn, acc, "forward.decode_attention", time.perf_counter)
    for module, name in FUSED_OP_CALLS:  # the fused CPU kernels run outside torch operators too
        wrap(module, name, acc, "forward.fused_ops")
    wrap(runner, "_sample", acc, "logits_and_sampling")
    wrap(runner.model, "compute_logits", acc, "logits_and_sampling.lm_head")
    wrap(runner.sampler, "forward", acc, "logits_and_sampling.sampler")
    wrap(eng.scheduler, "update_from_output", acc, "scheduler_update")
    wrap(eng.output_processor, "process", acc, "outputs_detokenize")
    walls, phases = [], defaultdict(list)
    for _ in range(args.steps):
        acc.clear()
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
        for k, v in acc.items():
            phases[k].append(v)
    wall = statistics.median(walls)
    per_step = {k: statistics.median(v) for k, v in phases.items()}
    # Python overhead: each of a few more steps profiled on its own; the step's wall time minus
    # the time inside torch operators (and the C decode kernel) in that same step. The median
    # over steps: on a shared machine a step that lost its core for a while is an outlier.
    kinds_per_step, python_fracs = defaultdict(list), []
    for _ in range(args.profile_steps):
        acc.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            eng.step()
            step_wall = time.perf_counter() - t0
        kinds = operator_time_by_kind(prof)
        # the fused C decode kernel runs outside torch operators: count it as attention, not Python;
        # likewise the fused norm/activation/rotary kernels as other ops
        kinds["attention"] += acc.get("forward.decode_attention", 0.0)
        kinds["other_ops"] += acc.get("forward.fused_ops", 0.0)
        for k, v in kinds.items():
            kinds_per_step[k].append(v)
        python_fracs.append(max(step_wall - sum(kinds.values()), 0.0) / step_wall)
    kinds = {k: statistics.median(v) for k, v in kinds_per_step.items()}
    python_fraction = statistics.median(python_fracs)
    lm_head = per_step.get("logits_and_sampling.lm_head", 0.0)
    sampling = per_step.get("logits_and_sampling", 0.0) - lm_head
    fractions = {"python_overhead": python_fraction,
                 "lm_head": lm_head / wall,
                 # everything of _sample but the lm_head matmul: row gather, sampling metadata,
                 # logits processing, the sampler, the host copy of the ids
                 "logits_processing_and_sampling": sampling / wall,
                 "forward": per_step.get("forward", 0.0) / wall,
                 "host_phases": sum(per_step.get(k, 0.0) for k in HOST_PHASES) / wall}
    rec = {"load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()], "batch": args.batch,
           "dtype": args.dtype, "quantization": args.quantization, "params": params_desc(params), "step_wall_s": wall,
           "step_wall_s_min_max": [min(walls), max(walls)], "phases_s": per_step,
           "op_time_by_kind_s": kinds, "python_overhead_s": python_fraction * wall,
           "python_overhead_fraction": python_fraction, "fractions_of_step": fractions,
           "tokens_per_s": args.batch / wall, "torch_threads": torch.get_num_threads(),
           "command": "benchmarks/step_profile.py " + " ".join(sys.argv[1:])}
    if args.cpu_time_steps:
        rec["cpu_time_ms_per_step_1_thread"] = cpu_time_breakdown(eng, args.cpu_time_steps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=2))
    phases_txt = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in per_step.items())
    ops = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in kinds.items())
    fr = ", ".join(f"{k} {v:.1%}" for k, v in fractions.items())
    print(f"decode step at batch {args.batch} ({args.dtype}): {wall * 1e3:.1f} ms = {args.batch / wall:.0f} tok/s; "
          f"phases (ms): {phases_txt}; operators (ms): {ops}; fractions of the step: {fr}"
          + ("; 1-thread CPU ms: " + ", ".join(f"{k} {v:.1%}" if k.endswith("fraction") else f"{k} {v:.1f}"
                                                for k, v in rec["cpu_time_ms_per_step_1_thread"].items())
             if args.cpu_time_steps else ""))


HOST_PHASES = ("schedule", "input_prep", "scheduler_update", "outputs_detokenize")
# (module, function) of the layers' calls into pagedllm.ops (C kernels, outside torch operators)
FUSED_OP_CALLS = [(norm_module, "rms_norm"), (norm_module, "fused_add_rms_norm_"), (activation_module, "act_and_mul"),
                  (attention_module, "rope_qk")]


# Profiler event namespaces that are operators (time inside a kernel, not Python): torch's own
# (aten, prims), the CPU backends linear algebra dispatches to (oneDNN as mkldnn/onednn, MKL's
# packed GEMM as mkl), quantized kernels, and the engine's custom ops. Every other event
# (record_function ranges, "ProfilerStep#N") is host code, whose self time is Python.
OPERATOR_NAMESPACES = frozenset({"aten", "prims", "mkldnn", "onednn", "mkl", "quantized", "_quantized",
                                 "pagedllm"})
# Words of an operator name (split at "_") that make it a matrix multiply: aten::mm, aten::addmm,
# aten::_weight_int4pack_mm, mkldnn::_linear_pointwise, mkl::_mkl_linear, onednn::qlinear_pointwise.
MATMUL_WORDS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "matmul", "linear",
                          "qlinear", "gemm", "gemv", "dot", "vdot"})
# Attention: the SDPA kernels, the engine's paged-attention op, and the K/V gathers and writes.
ATTENTION_WORDS = ("attention", "index_select", "index_copy")


def operator_kind(name: str) -> str | None:
    """The kind of a profiler event: "matmul", "attention", "other_ops", or None when the event is
    not an operator (its self time is then host/Python time).

    ``name`` is the event key, "namespace::op" (e.g. "aten::addmm", "mkl::_mkl_linear").
    Attention is checked first, so aten::scaled_dot_product_attention (whose words include "dot")
    counts as attention; its inner aten::bmm calls are their own events and count as matmul.
    """
    namespace, sep, op = name.partition("::")
    if not sep or namespace not in OPERATOR_NAMESPACES:
        return None
    if any(w in op for w in ATTENTION_WORDS):
        return "attention"
    if MATMUL_WORDS.intersection(op.lower().split("_")):
        return "matmul"
    return "other_ops"


def operator_time_by_kind(prof) -> dict[str, float]:
    """Self time (s) of the profiled torch operators, by kind (``operator_kind``): matmul,
    attention, other_ops. Events that are not operators are left out (they are Python time)."""
    kinds: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        kind = operator_kind(evt.key)
        if kind is not None:
            kinds[kind] += evt.self_cpu_time_total / 1e6
    return kinds


def params_desc(params) -> str:
    return f"temperature={params.temperature}, max_tokens={params.max_tokens}, ignore_eos={params.ignore_eos}"


if __name__ == "__main__":
    main()
