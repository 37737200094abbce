"""GPU decode attention by KV-cache dtype: the Triton backend over bf16, fp8 and int8 caches (CUDA only).

One attention layer of a Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128, bf16
queries, block size 16, shuffled block tables), decode batches at a few (batch, context)
points; the cache holds the same random K/V written by the backend's own writer in each dtype
(:mod:`pagedllm.attention.triton_kv_dtype`: fp8 e4m3 codes with the per-tensor scale, int8
codes with per token-and-head float32 scales). Reported per dtype: milliseconds per call
(KV write + attention), the KV bytes read per second (codes + scales), and the largest
difference to the bf16 cache's output (the quantization's effect, not a kernel error).

    python benchmarks/gpu_kv_dtype.py [--out benchmarks/results/gpu/kv_dtype.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

import common

sys.path.insert(0, str(common.REPO_ROOT))  # run from a checkout without installing

from gpu_attention import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, bench_ms  # noqa: E402

POINTS = [(1, 32768), (64, 2048), (256, 2048)]
KV_DTYPES = ["bfloat16", "fp8_e4m3", "int8"]


def time_dtype(reqs, name: str) -> tuple[float, float, torch.Tensor]:
    """(ms per call, KV bytes read per call, output) of the Triton backend over a cache of ``name``."""
    from pagedllm.attention.backend import write_kv_cache
    from pagedllm.attention.triton_paged import TritonPagedAttention
    from pagedllm.quantization.kv_cache import resolve_kv_cache_dtype
    from tests.model_utils import allocate_block_tables, make_metadata

    spec = resolve_kv_cache_dtype(name, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    seq_lens = [c + q for c, q in reqs]
    tables, num_blocks = allocate_block_tables(seq_lens, BLOCK_SIZE, 0)
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=spec.storage, device="cuda")
    scales = torch.ones(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, device="cuda") if spec.has_token_scales else None
    kv = torch.randn(2, num_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g, device="cuda")
    write_kv_cache(kv[0], kv[1], cache, torch.arange(num_blocks * BLOCK_SIZE, device="cuda"), scales)
    meta = make_metadata([c for c, _ in reqs], [q for _, q in reqs], tables, BLOCK_SIZE, "cuda")
    num_tokens = sum(q for _, q in reqs)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=g, device="cuda").to(torch.bfloat16)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g, device="cuda").to(torch.bfloat16)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g, device="cuda").to(torch.bfloat16)
    backend = TritonPagedAttention()
    extra = {"kv_scales": scales} if scales is not None else {}
    scale = HEAD_DIM**-0.5
    impl = backend.make_impl(scale)
    out = impl.forward(query, key, value, cache, meta, **extra)
    ms = bench_ms(lambda: impl.forward(query, key, value, cache, meta, **extra))
    kv_bytes = 2 * sum(seq_lens) * NUM_KV_HEADS * spec.bytes_per_token_head(HEAD_DIM)
    return ms, kv_bytes, out


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "gpu" / "kv_dtype.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    points = []
    for batch, ctx in POINTS:
        reqs = [(ctx - 1, 1)] * batch
        row = {"batch": batch, "context": ctx}
        base = None
        for name in KV_DTYPES:
            ms, kv_bytes, out = time_dtype(reqs, name)
            base = out.float() if base is None else base
            row[name] = {"ms": ms, "kv_gb_per_s": kv_bytes / ms / 1e6,
                         "max_abs_diff_vs_bfloat16": (out.float() - base).abs().max().item()}
            print(f"B={batch} ctx={ctx} {name}: {ms:.3f} ms, {kv_bytes / ms / 1e6:.0f} GB/s of KV, "
                  f"max |diff| vs bf16 {row[name]['max_abs_diff_vs_bfloat16']:.3g}", flush=True)
        points.append(row)
    record = {"device": torch.cuda.get_device_name(0), "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS,
              "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE}, "points": points}
    print(f"wrote {common.write_result('gpu_kv_dtype', record, args.out)}")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
