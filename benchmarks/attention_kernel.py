"""Decode attention per layer: the PyTorch backend (gather + SDPA) vs the fused C kernel.

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64), ``--batch`` decodes (64) with
context lengths drawn uniformly from ``ctx ± 15 %`` (fixed seed), block size 16, shuffled block
tables, KV caches in float32, bfloat16, fp8 (e4m3) and int8 (per token-and-head scales; the torch
backend dequantizes the gathered blocks, the kernel as it reads). One timed sample = ``--layers`` (30) backend calls
(KV write + attention) inside one forward context, the way a model step runs them, divided by
the number of layers; the two backends are measured alternately, sample after sample, so a
noisy shared machine hurts both alike; medians are reported.

``--baseline CHECKOUT`` adds a third backend, the C kernel of another checkout (e.g. ``/work/main``,
loaded from its ``pagedllm/attention/cpu_paged.py``), alternated with the two others: a
before/after comparison in one run.

``--model-step`` also times a whole SmolLM2-135M decode step (float32 forward + logits) at the
same batch with each backend (the model's attention backend swapped in place, alternately).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/attention_kernel.py               # ~20 s
    OMP_WAIT_POLICY=PASSIVE python benchmarks/attention_kernel.py --model-step  # + model load
    python benchmarks/attention_kernel.py --quick                               # smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

import common

sys.path.insert(0, str(common.REPO_ROOT))  # run from a checkout without installing

from pagedllm.attention import CpuPagedAttention, TorchPagedAttention  # noqa: E402
from pagedllm.attention.backend import AttentionMetadata, set_forward_context  # noqa: E402
from pagedllm.quantization.kv_cache import quantize_kv, resolve_kv_cache_dtype  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 9, 3, 64, 30
DTYPES = {"float32": "auto", "bfloat16": "bfloat16", "fp8": "fp8", "int8": "int8"}  # name -> kv_cache_dtype
# kernel vs torch backend on the timed inputs (both read the same stored values; the bfloat16 query differs)
MAX_ABS_DIFF = {"float32": 1e-4, "bfloat16": 5e-2, "fp8": 1e-4, "int8": 1e-4}


def decode_metadata(seq_lens: list[int], block_size: int, gen: torch.Generator) -> tuple[AttentionMetadata, int]:
    """A decode-only step: request i has seq_lens[i] tokens (the last one new), shuffled blocks.
    Returns (metadata, num_blocks in the pool)."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 8
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(needed)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[start:start + n]
        start += n
    last = torch.tensor([n - 1 for n in seq_lens])
    slots = tables[torch.arange(len(seq_lens)), last // block_size].long() * block_size + last % block_size
    b = len(seq_lens)
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(b + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables, num_decodes=b,
        num_decode_tokens=b, max_query_len=1, max_seq_len=max(seq_lens),
        query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=list(seq_lens))
    return meta, num_blocks


def time_layers(backend, inputs, caches, meta: AttentionMetadata) -> float:
    """Seconds per layer of one step: len(caches) backend calls under one forward context."""
    query, key, value = inputs
    impl = backend.make_impl(HEAD_DIM**-0.5)
    t0 = time.perf_counter()
    with set_forward_context(meta):
        for cache, scales in caches:
            impl.forward(query, key, value, cache, meta, **scales)
    return (time.perf_counter() - t0) / len(caches)


def random_cache(num_blocks: int, block_size: int, kv_cache_dtype: str, gen: torch.Generator
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A random cache in the storage of ``kv_cache_dtype`` (quantized as the writers do) and the
    backend's extra arguments (an int8 cache's ``kv_scales``)."""
    spec = resolve_kv_cache_dtype(kv_cache_dtype, torch.float32)
    x = torch.randn(2 * num_blocks * block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    stored, scales = quantize_kv(x, spec.storage)
    cache = stored.view(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    if scales is None:
        return cache, {}
    return cache, {"kv_scales": scales.view(2, num_blocks, block_size, NUM_KV_HEADS)}


def bench_attention(args, name: str, backends: dict[str, object]) -> dict[str, float]:
    gen = torch.Generator().manual_seed(args.seed)
    spread = int(0.15 * args.ctx)
    seq_lens = torch.randint(args.ctx - spread, args.ctx + spread + 1, (args.batch,), generator=gen).tolist()
    meta, num_blocks = decode_metadata(seq_lens, args.block_size, gen)
    caches = [random_cache(num_blocks, args.block_size, DTYPES[name], gen) for _ in range(args.layers)]
    dtype = torch.bfloat16 if name == "bfloat16" else torch.float32  # the model (query) dtype
    inputs = (torch.randn(args.batch, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype),
              torch.randn(args.batch, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
              torch.randn(args.batch, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype))
    with set_forward_context(meta):  # same answer from all (sanity check, not a test)
        outs = [b.make_impl(HEAD_DIM**-0.5).forward(*inputs, caches[0][0].clone(), meta, **caches[0][1]).float()
                for b in backends.values()]
    max_diff = max((outs[0] - out).abs().max().item() for out in outs[1:])
    samples: dict[str, list[float]] = {name: [] for name in backends}
    for rep in range(args.warmup + args.reps):
        for name, backend in backends.items():
            t = time_layers(backend, inputs, caches, meta)
            if rep >= args.warmup:
                samples[name].append(t)
    kv_bytes = 2 * sum(seq_lens) * NUM_KV_HEADS * (HEAD_DIM * caches[0][0].element_size() + 4 * bool(caches[0][1]))
    result = {f"{name}_ms": 1e3 * statistics.median(s) for name, s in samples.items()}
    result.update(max_abs_diff=max_diff, kv_mib_per_layer=kv_bytes / 2**20,
                  kernel_gib_s=kv_bytes / 2**30 / (result["kernel_ms"] / 1e3),
                  speedup=result["torch_ms"] / result["kernel_ms"], mean_ctx=statistics.mean(seq_lens))
    if "baseline" in backends:
        result["speedup_vs_baseline"] = result["baseline_ms"] / result["kernel_ms"]
    return result


def load_baseline(checkout: str):
    """The CpuPagedAttention of another checkout's ``pagedllm/attention/cpu_paged.py`` (its own C source;
    the rest of pagedllm comes from this one)."""
    path = os.path.join(checkout, "pagedllm", "attention", "cpu_paged.py")
    spec = importlib.util.spec_from_file_location("baseline_cpu_paged", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    backend = module.CpuPagedAttention()
    if not backend.is_kernel_available:
        sys.exit(f"the baseline kernel of {checkout} did not build")
    return backend


def bench_model_step(args, backends: dict[str, object]) -> dict[str, float]:
    """Median seconds of a full SmolLM2 decode step (forward + logits) with each backend."""
    from pagedllm.loader import load_model_files
    from pagedllm.models import get_model_class

    files = load_model_files(args.model)
    model = get_model_class(files.hf_config)(files.hf_config, dtype=torch.float32, device="cpu")
    model.load_weights(files.weights(torch.float32))
    model.eval()
    gen = torch.Generator().manual_seed(args.seed)
    spread = int(0.15 * args.ctx)
    seq_lens = torch.randint(args.ctx - spread, args.ctx + spread + 1, (args.batch,), generator=gen).tolist()
    meta, num_blocks = decode_metadata(seq_lens, args.block_size, gen)
    model.bind_kv_caches([torch.randn(2, num_blocks, args.block_size, model.num_kv_heads, model.head_dim,
                                      generator=gen) for _ in range(model.num_layers)])
    ids = torch.randint(common.FIRST_ORDINARY_TOKEN_ID, model.vocab_size, (args.batch,), generator=gen)
    positions = torch.tensor(seq_lens) - 1
    attns = [m for m in model.modules() if hasattr(m, "backend") and hasattr(m, "kv_cache")]
    samples: dict[str, list[float]] = {name: [] for name in backends}
    with torch.inference_mode():
        for rep in range(args.warmup + args.step_reps):
            for name, backend in backends.items():
                for m in attns:
                    m.backend = backend
                t0 = time.perf_counter()
                with set_forward_context(meta):
                    model.compute_logits(model(ids, positions))
                if rep >= args.warmup:
                    samples[name].append(time.perf_counter() - t0)
    return {f"{name}_step_ms": 1e3 * statistics.median(s) for name, s in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=300, help="mean context length (tokens)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=NUM_LAYERS)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (both backends; the kernel splits requests over as many threads)")
    p.add_argument("--baseline", default=None, metavar="CHECKOUT",
                   help="also time the C kernel of another checkout (e.g. /work/main), alternated")
    p.add_argument("--model-step", action="store_true", help="also time a full SmolLM2 decode step")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--step-reps", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, no JSON")
    p.add_argument("--out", default=None, help="JSON path (default results/attention_kernel.json)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.batch, args.ctx, args.layers, args.reps, args.warmup, args.step_reps = 4, 40, 2, 2, 1, 1
    kernel_backend = CpuPagedAttention()
    if not kernel_backend.is_kernel_available:
        sys.exit("the C kernel did not build (see the warning above)")
    backends = {"torch": TorchPagedAttention(), "kernel": kernel_backend}
    if args.baseline:
        backends["baseline"] = load_baseline(args.baseline)
    record = {"config": {k: v for k, v in vars(args).items() if k not in ("out",)},
              "threads": torch.get_num_threads(), "load_avg_before": os.getloadavg()[0], "attention": {}}
    for name in args.dtypes:
        record["attention"][name] = result = bench_attention(args, name, backends)
        if result["max_abs_diff"] > MAX_ABS_DIFF[name]:
            sys.exit(f"{name}: kernel and torch backend differ by {result['max_abs_diff']:.3g}")
    if args.model_step:
        record["model_step"] = bench_model_step(args, backends)
    record["load_avg_after"] = os.getloadavg()[0]  # a shared machine: other jobs' load, for context
    parts = [f"{name}: torch {r['torch_ms']:.3f} ms, kernel {r['kernel_ms']:.3f} ms per layer "
             f"({r['speedup']:.2f}x, {r['kernel_gib_s']:.1f} GiB/s)"
             + (f", baseline {r['baseline_ms']:.3f} ms ({r['speedup_vs_baseline']:.2f}x)" if args.baseline else "")
             for name, r in record["attention"].items()]
    if args.model_step:
        s = record["model_step"]
        parts.append(f"SmolLM2 decode step: torch {s['torch_step_ms']:.1f} ms, kernel {s['kernel_step_ms']:.1f} ms")
    print(f"attention_kernel B={args.batch} ctx~{args.ctx} block {args.block_size} "
          f"threads {record['threads']}: " + "; ".join(parts))
    if not args.quick:
        print(f"wrote {common.write_result('attention_kernel', record, args.out)}")


if __name__ == "__main__":
    main()
