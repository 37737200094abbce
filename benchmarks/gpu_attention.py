"""GPU paged attention: decode achieved bandwidth vs the device's peak, prefill TFLOP/s (CUDA only).

One attention layer of a Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128, bf16,
block size 16) over a paged cache with shuffled block tables.

- **Decode**: batches of one-token queries at several (batch, context) points. Decode
  attention reads every context token's K and V once, so its speed is
  ``bytes = Σ seq_len × 2 × num_kv_heads × head_dim × 2`` over the time; reported against
  the device's peak memory bandwidth, both the nominal figure of the part (table below) and
  a measured device-to-device copy (bytes read + written per second).
- **Prefill**: causal attention of long queries (one 4096-token prompt, four 2048-token
  prompts, a 2048-token chunk after 6144 cached tokens);
  ``FLOPs = 4 × num_heads × head_dim × Σ_queries keys seen``, reported in TFLOP/s against a
  measured 8192³ bf16 matmul, with torch's SDPA (FlashAttention-2 kernels) on the same
  contiguous Q/K/V side by side.

Systems: ``triton`` (the backend as the engine runs it: split-KV for small decode batches),
``triton_unified`` (split-KV off), ``torch`` (the reference backend), ``flashinfer`` when
installed. Every system's output is checked against ``torch`` (bf16, 2e-2) before timing.

    python benchmarks/gpu_attention.py [--out benchmarks/results/gpu/attention.json] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

import common

sys.path.insert(0, str(common.REPO_ROOT))  # run from a checkout without installing

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_POINTS = [(1, 4096), (1, 32768), (8, 4096), (32, 2048), (64, 8192), (128, 1024), (256, 2048)]
PREFILL_POINTS = {"1x4096": [(0, 4096)], "4x2048": [(0, 2048)] * 4, "chunk 2048 after 6144": [(6144, 2048)]}

# Nominal peak memory bandwidth (GB/s) of common parts, from the vendors' data sheets.
NOMINAL_BANDWIDTH_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
                          "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L4": 300, "A10G": 600, "A10": 600,
                          "RTX 4090": 1008, "RTX 3090": 936, "T4": 320}


def nominal_bandwidth(name: str) -> float | None:
    """The data-sheet bandwidth of the part whose name matches ``name`` (longest key first), GB/s."""
    for key in sorted(NOMINAL_BANDWIDTH_GBPS, key=len, reverse=True):
        if key.replace(" ", "").lower() in name.replace(" ", "").lower():
            return NOMINAL_BANDWIDTH_GBPS[key]
    return None


def bench_ms(fn) -> float:
    """Median milliseconds of ``fn`` (triton's do_bench: warm-up, L2 flushed between runs)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def measured_copy_gbps() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return 2 * x.numel() * 2 / ms / 1e6  # read + write


def measured_matmul_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    b = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    ms = bench_ms(lambda: a @ b)
    return 2 * 8192**3 / ms / 1e9


def make_batch(reqs: list[tuple[int, int]], seed: int = 0):
    """(query, key, value, kv_cache, metadata) for requests [(context_len, query_len)], cache filled."""
    from tests.model_utils import allocate_block_tables, make_metadata

    g = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    tables, num_blocks = allocate_block_tables(seq_lens, BLOCK_SIZE, seed)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g, device="cuda").to(DTYPE)
    meta = make_metadata([c for c, _ in reqs], [q for _, q in reqs], tables, BLOCK_SIZE, "cuda")
    num_tokens = sum(q for _, q in reqs)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=g, device="cuda").to(DTYPE)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g, device="cuda").to(DTYPE)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g, device="cuda").to(DTYPE)
    return query, key, value, cache, meta


def systems() -> dict[str, object]:
    from pagedllm.attention import TorchPagedAttention
    from pagedllm.attention.triton_paged import TritonPagedAttention

    out = {"triton": TritonPagedAttention(), "triton_unified": TritonPagedAttention(split_kv_max_programs=0),
           "torch": TorchPagedAttention()}
    if importlib.util.find_spec("flashinfer") is not None:
        from pagedllm.attention.flashinfer_paged import FlashInferPagedAttention
        out["flashinfer"] = FlashInferPagedAttention()
    return out


def time_point(reqs, backends) -> dict[str, float]:
    """Milliseconds per call of each backend on one batch (outputs checked against torch first)."""
    from pagedllm.attention.backend import set_forward_context

    query, key, value, cache, meta = make_batch(reqs)
    scale = HEAD_DIM**-0.5
    ref = backends["torch"].make_impl(scale).forward(query, key, value, cache, meta)
    times = {}
    for name, backend in backends.items():
        with set_forward_context(meta):
            out = backend.make_impl(scale).forward(query, key, value, cache, meta)
            err = (out.float() - ref.float()).abs().max().item()
            if err > 2e-2:
                raise SystemExit(f"{name} disagrees with torch by {err} on {reqs[:3]}...")
            impl = backend.make_impl(scale)
            times[name] = bench_ms(lambda impl=impl: impl.forward(query, key, value, cache, meta))
    return times


def sdpa_ms(reqs) -> float:
    """torch SDPA (flash kernels) on contiguous Q/K/V of the same shapes, causal bottom-right."""
    import torch.nn.functional as F

    calls = []
    for c, q in reqs:
        qt = torch.randn(1, NUM_HEADS, q, HEAD_DIM, dtype=DTYPE, device="cuda")
        kt = torch.randn(1, NUM_KV_HEADS, c + q, HEAD_DIM, dtype=DTYPE, device="cuda")
        mask = None if c == 0 else (torch.arange(c + q, device="cuda")[None, :]
                                    <= torch.arange(c, c + q, device="cuda")[:, None])
        calls.append((qt, kt, mask))

    def run():
        for qt, kt, mask in calls:
            F.scaled_dot_product_attention(qt, kt, kt, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return bench_ms(run)


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "gpu" / "attention.json")
    p.add_argument("--quick", action="store_true", help="two decode points, one prefill point")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_attention.py needs a CUDA device")
    name = torch.cuda.get_device_name(0)
    copy_gbps, matmul_tflops = measured_copy_gbps(), measured_matmul_tflops()
    nominal = nominal_bandwidth(name)
    backends = systems()
    decode = []
    for batch, ctx in DECODE_POINTS[:2] if args.quick else DECODE_POINTS:
        reqs = [(ctx - 1, 1)] * batch
        times = time_point(reqs, backends)
        num_bytes = batch * ctx * 2 * NUM_KV_HEADS * HEAD_DIM * 2
        row = {"batch": batch, "context": ctx, "kv_bytes": num_bytes,
               "ms": {k: round(v, 4) for k, v in times.items()},
               "achieved_gbps": {k: round(num_bytes / v / 1e6, 1) for k, v in times.items()}}
        if nominal:
            row["fraction_of_nominal_peak"] = {k: round(g / nominal, 3) for k, g in row["achieved_gbps"].items()}
        row["fraction_of_measured_copy"] = {k: round(g / copy_gbps, 3) for k, g in row["achieved_gbps"].items()}
        decode.append(row)
        print(f"decode b={batch} ctx={ctx}: " + ", ".join(f"{k} {g:.0f} GB/s" for k, g in row["achieved_gbps"].items()),
              file=sys.stderr)
    prefill = []
    points = dict(list(PREFILL_POINTS.items())[:1]) if args.quick else PREFILL_POINTS
    for label, reqs in points.items():
        times = time_point(reqs, backends)
        times["torch_sdpa_contiguous"] = sdpa_ms(reqs)
        flops = sum(4 * NUM_HEADS * HEAD_DIM * sum(c + i + 1 for i in range(q)) for c, q in reqs)
        row = {"point": label, "flops": flops, "ms": {k: round(v, 4) for k, v in times.items()},
               "tflops": {k: round(flops / v / 1e9, 1) for k, v in times.items()}}
        row["fraction_of_measured_matmul"] = {k: round(t / matmul_tflops, 3) for k, t in row["tflops"].items()}
        prefill.append(row)
        print(f"prefill {label}: " + ", ".join(f"{k} {t:.0f} TFLOP/s" for k, t in row["tflops"].items()),
              file=sys.stderr)
    record = {"device": name, "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                                        "block_size": BLOCK_SIZE, "dtype": "bfloat16"},
              "nominal_bandwidth_gbps": nominal, "measured_copy_gbps": round(copy_gbps, 1),
              "measured_bf16_matmul_tflops": round(matmul_tflops, 1), "decode": decode, "prefill": prefill}
    path = common.write_result("gpu_attention", record, args.out)
    best = max(decode, key=lambda r: r["achieved_gbps"]["triton"])
    print(f"gpu attention [{name}]: decode up to {best['achieved_gbps']['triton']:.0f} GB/s (triton, b={best['batch']} "
          f"ctx={best['context']}; copy {copy_gbps:.0f} GB/s); prefill {prefill[0]['tflops']['triton']:.0f} TFLOP/s "
          f"({prefill[0]['point']}; matmul {matmul_tflops:.0f}) -> {path}")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
