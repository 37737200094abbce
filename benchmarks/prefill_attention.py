"""Prefill attention per layer over a long cached context: the C kernel vs the torch backend.

One request prefills a ``--chunk``-token chunk (default 2,048) after ``--contexts`` tokens already
in its paged cache (block size 16, shuffled blocks), with full causal attention, a sliding window
(``--window``, Gemma 3's 512) and a logit soft cap (``--soft-cap``, Gemma 2's 50): the shapes of
SmolLM2 (9 query / 3 KV heads of 64) or Gemma 3 270M (4 / 1 of 256). Each sample is one
backend call (KV write + attention), the two backends alternated sample after sample; timed as
thread CPU time on one torch thread (steadier than wall time on a shared machine), medians
reported, with the attention FLOPs actually needed (4 x heads x head_dim x visible keys summed
over the queries: quadratic in the context for full attention, linear under a window) and the
peak RSS above the call's start (the torch backend's masked path materializes a (chunk x keys)
score matrix per head; the kernel's scratch is a few hundred KiB per thread).

    .venv/bin/python benchmarks/prefill_attention.py                       # ~1 min
    .venv/bin/python benchmarks/prefill_attention.py --shape smollm2 --contexts 0,2048,6144
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

import common
from long_context import PeakRss

sys.path.insert(0, str(common.REPO_ROOT))  # run from a checkout without installing

from pagedllm.attention import CpuPagedAttention, TorchPagedAttention  # noqa: E402
from pagedllm.attention.backend import AttentionMetadata, set_forward_context  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}  # (query heads, KV heads, head_dim)
BLOCK_SIZE = 16


def prefill_case(context: int, chunk: int, shape: tuple[int, int, int], gen: torch.Generator):
    """(query, key, value, kv_cache, metadata): one prefill of ``chunk`` tokens after ``context``
    cached ones (random values), shuffled blocks."""
    num_heads, num_kv_heads, head_dim = shape
    total = context + chunk
    num_blocks = -(-total // BLOCK_SIZE) + 4
    table = torch.randperm(num_blocks, generator=gen)[:-(-total // BLOCK_SIZE)].to(torch.int32).unsqueeze(0)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(chunk, num_heads, head_dim, generator=gen)
    key = torch.randn(chunk, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(chunk, num_kv_heads, head_dim, generator=gen)
    positions = torch.arange(context, total)
    slots = table[0, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor([0, chunk], dtype=torch.int32),
        seq_lens=torch.tensor([total], dtype=torch.int32), block_tables=table, num_decodes=0, num_decode_tokens=0,
        max_query_len=chunk, max_seq_len=total, query_start_loc_cpu=[0, chunk], seq_lens_cpu=[total])
    return query, key, value, cache, meta


def attention_flops(context: int, chunk: int, shape: tuple[int, int, int], window: int | None) -> float:
    """4 x heads x head_dim x (keys each query sees), summed over the chunk's queries (QK^T and PV)."""
    num_heads, _, head_dim = shape
    keys = sum(min(p + 1, window or p + 1) for p in range(context, context + chunk))
    return 4.0 * num_heads * head_dim * keys


def time_call(backend, case, scale: float, window: int | None, soft_cap: float | None) -> tuple[float, float, torch.Tensor]:
    """(thread CPU seconds, peak RSS above start in MiB, output) of one forward call."""
    query, key, value, cache, meta = case
    impl = backend.make_impl(scale, sliding_window=window, logit_soft_cap=soft_cap)
    with set_forward_context(meta), PeakRss() as rss:
        t0 = time.thread_time()
        out = impl.forward(query, key, value, cache, meta)
        elapsed = time.thread_time() - t0
    return elapsed, rss.peak_above_start / 2**20, out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="gemma3", choices=list(SHAPES))
    p.add_argument("--contexts", default="0,2048,6144", help="cached tokens before the chunk, comma-separated")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--soft-cap", type=float, default=50.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default results/prefill_attention.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    shape = SHAPES[args.shape]
    scale = shape[2] ** -0.5
    kernel_backend, torch_backend = CpuPagedAttention(), TorchPagedAttention()
    if not kernel_backend.is_kernel_available:
        raise SystemExit("the C kernel could not be built (no compiler?)")
    modes = {"causal": (None, None), "window": (args.window, None), "soft_cap": (None, args.soft_cap),
             "window+soft_cap": (args.window, args.soft_cap)}
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for context in (int(x) for x in args.contexts.split(",")):
        case = prefill_case(context, args.chunk, shape, gen)
        for mode, (window, soft_cap) in modes.items():
            times: dict[str, list[float]] = {"kernel": [], "torch": []}
            peaks: dict[str, float] = {"kernel": 0.0, "torch": 0.0}
            outs = {}
            for _ in range(args.reps):
                for name, backend in (("kernel", kernel_backend), ("torch", torch_backend)):
                    t, peak, outs[name] = time_call(backend, case, scale, window, soft_cap)
                    times[name].append(t)
                    peaks[name] = max(peaks[name], peak)
            flops = attention_flops(context, args.chunk, shape, window)
            row = {"context": context, "chunk": args.chunk, "mode": mode, "window": window, "soft_cap": soft_cap,
                   "attention_gflop": round(flops / 1e9, 4),
                   "max_abs_diff": float((outs["kernel"] - outs["torch"]).abs().max())}
            for name in times:
                med = statistics.median(times[name])
                row[f"{name}_cpu_ms"] = round(1e3 * med, 2)
                row[f"{name}_gflops"] = round(flops / med / 1e9, 1)
                row[f"{name}_peak_rss_mib"] = round(peaks[name], 1)
            row["speedup"] = round(row["torch_cpu_ms"] / row["kernel_cpu_ms"], 2)
            rows.append(row)
            print(f"ctx {context:5d} {mode:15s} kernel {row['kernel_cpu_ms']:8.1f} ms ({row['kernel_gflops']:5.1f} "
                  f"GFLOP/s, +{row['kernel_peak_rss_mib']:.0f} MiB)  torch {row['torch_cpu_ms']:8.1f} ms "
                  f"({row['torch_gflops']:5.1f} GFLOP/s, +{row['torch_peak_rss_mib']:.0f} MiB)  {row['speedup']:.2f}x  "
                  f"diff {row['max_abs_diff']:.1e}", file=sys.stderr)
    record = {"shape": dict(zip(("num_heads", "num_kv_heads", "head_dim"), shape), name=args.shape),
              "block_size": BLOCK_SIZE, "threads": 1, "reps": args.reps, "rows": rows}
    path = common.write_result("prefill_attention", record, args.out)
    print(f"prefill attention ({args.shape}, chunk {args.chunk}): " + "; ".join(
        f"ctx {r['context']} {r['mode']} {r['speedup']:.2f}x" for r in rows) + f" -> {path}")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
