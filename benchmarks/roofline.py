"""This machine's roofline for decoding the default model, and the engine against it.

Measures, with torch on this machine (default: all cores torch uses):

1. matmul rate (GFLOP/s) in float32 and bfloat16 at every distinct weight shape of
   SmolLM2-135M (the faster of ``F.linear`` and oneDNN's prepacked linear);
2. memory bandwidth (GB/s) of one large tensor copy (bytes read + bytes written);
3. the time of the model's whole stack of weight matmuls (30 layers × q, k, v, o, gate,
   up, down + lm_head, every layer's weights distinct so they stream from memory) at
   batch 1…256 — the decode rate no engine can beat on these matmuls.

From (1) and (2) it derives the classic roofline ceiling for decode at batch B
(Williams et al., "Roofline", CACM 2009; as applied to LLM decode in the vLLM paper):

    tokens/s(B) = B / max(weight_bytes / bandwidth + B · ctx · kv_bytes_per_token / bandwidth,
                          B · 2 · num_params / matmul_rate)

(memory-bound at small B: every step reads all weights once; compute-bound at large B).
Given ``--engine-tps`` or a throughput JSON it prints the engine's rate as a fraction of
the compute ceiling (its prompt + output tokens, since prefill tokens cost the same matmul
FLOPs as decode tokens).

    python benchmarks/roofline.py                 # full run (~1 min)
    python benchmarks/roofline.py --quick         # a few seconds
    python benchmarks/roofline.py --engine-json benchmarks/results/throughput.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch
import torch.nn.functional as F

import common

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelShape:
    """The dense shapes of a Llama-architecture decoder (defaults: SmolLM2-135M-Instruct)."""

    num_layers: int = 30
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    vocab_size: int = 49152

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """(name, in_features, out_features) of one layer's projections, then the lm_head."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h),
                ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]

    @property
    def num_matmul_params(self) -> int:
        """Weights every token multiplies by: all layers' projections + the lm_head (embedding lookup excluded)."""
        per_layer = sum(k * n for _, k, n in self.linear_shapes())
        return self.num_layers * per_layer + self.hidden_size * self.vocab_size

    @property
    def flops_per_token(self) -> int:
        """2 FLOP (multiply + add) per weight per token."""
        return 2 * self.num_matmul_params

    @property
    def prefill_flops_per_token(self) -> int:
        """A prompt token's matmul FLOP: every layer's projections, no lm_head (only a prompt's
        last token is sampled, and it is counted as an output token)."""
        return 2 * (self.num_matmul_params - self.hidden_size * self.vocab_size)

    def kv_bytes_per_token(self, elem_size: int) -> int:
        """K and V of one token in every layer, in bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem_size


SMOLLM2_135M = ModelShape()


def _time(fn, min_time_s: float, warmup: int = 2) -> float:
    """Fastest seconds of one ``fn()`` call over repeats filling ~``min_time_s`` (after warm-up).

    The minimum, not the median: a ceiling is what the machine can do, and on a shared
    machine the slower repeats measure the neighbours.
    """
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start >= min_time_s and len(times) >= 3:
            break
    return min(times)


def matmul_gflops(dtype: torch.dtype, m: int, k: int, n: int, min_time_s: float) -> float:
    """GFLOP/s of the faster of ``F.linear(x[m, k], w[n, k])`` and oneDNN's prepacked linear (the
    engine's path for prefill rows) in ``dtype``, 2·m·k·n FLOP per call. The faster, because a
    ceiling is what the machine can do: torch's float32 ``F.linear`` runs MKL, which takes AVX2
    code paths on AMD CPUs, where oneDNN's is about twice as fast."""
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    t = _time(lambda: F.linear(x, w), min_time_s)
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
        t = min(t, _time(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), min_time_s))
    return 2 * m * k * n / t / 1e9


def copy_bandwidth_gbs(num_bytes: int, min_time_s: float) -> float:
    """GB/s (1e9 bytes) of ``dst.copy_(src)`` on ``num_bytes`` of float32, counting read + write."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), min_time_s)
    return 2 * num_bytes / t / 1e9


class MatmulStack:
    """Every weight matmul of one decode step, each layer with its own weights.

    Holds ``num_layers`` distinct copies of the layer weights (so at small batch they
    stream from DRAM as in a real model, not from cache) plus the lm_head.
    Memory: ``num_matmul_params × elem_size`` bytes (≈0.54 GB float32 for SmolLM2-135M).
    """

    def __init__(self, shape: ModelShape, dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype
        self.layers = [[torch.randn(n, k).to(dtype) * 0.02 for _, k, n in shape.linear_shapes()]
                       for _ in range(shape.num_layers)]
        self.lm_head = (torch.randn(shape.vocab_size, shape.hidden_size) * 0.02).to(dtype)

    @property
    def weight_bytes(self) -> int:
        return self.shape.num_matmul_params * torch.finfo(self.dtype).bits // 8

    def step(self, batch: int) -> None:
        """Run all projections on ``batch`` token rows (x: [batch, in_features])."""
        xs = {k: torch.randn(batch, k).to(self.dtype) for k in
              {k for _, k, _ in self.shape.linear_shapes()}}
        for ws in self.layers:
            for w in ws:
                F.linear(xs[w.shape[1]], w)
        F.linear(xs[self.shape.hidden_size], self.lm_head)

    def tokens_per_s(self, batch: int, min_time_s: float) -> float:
        """Decode tokens/s if the step were only these matmuls: batch / seconds per step."""
        return batch / _time(lambda: self.step(batch), min_time_s, warmup=1)


def roofline_tps(batch: int, weight_bytes: int, bandwidth_gbs: float, gflops: float,
                 flops_per_token: int, kv_bytes_per_token: int = 0, context_len: int = 0) -> float:
    """Roofline decode ceiling in tokens/s at ``batch`` (see the module docstring)."""
    mem_s = (weight_bytes + batch * context_len * kv_bytes_per_token) / (bandwidth_gbs * 1e9)
    compute_s = batch * flops_per_token / (gflops * 1e9)
    return batch / max(mem_s, compute_s)


def workload_ceiling(prompt_tokens: int, output_tokens: int, shape: ModelShape, gflops: float) -> dict:
    """The fastest a workload of ``prompt_tokens`` prefill and ``output_tokens`` decode tokens can
    run at ``gflops`` (the matmul rate at the largest batch): its matmul FLOP over that rate,
    attention and everything else taken as free. Returns seconds and output tokens/s."""
    flop = prompt_tokens * shape.prefill_flops_per_token + output_tokens * shape.flops_per_token
    seconds = flop / (gflops * 1e9)
    return {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "matmul_tflop": round(flop / 1e12, 3),
            "min_seconds": round(seconds, 2), "max_output_tokens_per_s": round(output_tokens / seconds, 1)}


def load_engine_tps(path: Path) -> dict:
    """Read the pagedllm continuous-batching result from a ``throughput.py`` JSON record.

    Returns ``{"output_tokens_per_s", "total_tokens_per_s", "dtype", "source"}``.
    Raises ValueError when the file has no pagedllm continuous result.
    """
    rec = json.loads(Path(path).read_text())
    for name, sysrec in rec.get("systems", {}).items():
        if name.startswith("pagedllm") and "continuous" in name:
            return {"output_tokens_per_s": sysrec["output_tokens_per_s"],
                    "total_tokens_per_s": sysrec["total_tokens_per_s"],
                    "dtype": rec.get("dtype", "float32"), "source": str(path)}
    raise ValueError(f"--engine-json {path}: no 'pagedllm-continuous' entry under 'systems'")


def measure(dtypes: list[str], batches: list[int], min_time_s: float, copy_bytes: int,
            shape: ModelShape, context_len: int) -> dict:
    """All measurements and derived ceilings, as a JSON-ready dict."""
    bandwidth = copy_bandwidth_gbs(copy_bytes, min_time_s)
    per_dtype = {}
    big_m = max(batches)
    for name in dtypes:
        dt = DTYPES[name]
        elem = torch.finfo(dt).bits // 8
        shapes = shape.linear_shapes() + [("lm_head", shape.hidden_size, shape.vocab_size)]
        rates = {n: matmul_gflops(dt, big_m, k, out, min_time_s / 4) for n, k, out in shapes}
        # FLOP-weighted rate of the whole model: total FLOP / total time at batch big_m.
        weights = {n: (shape.num_layers if n != "lm_head" else 1) * k * out for n, k, out in shapes}
        model_gflops = sum(weights.values()) / sum(w / rates[n] for n, w in weights.items())
        stack = MatmulStack(shape, dt)
        measured = {b: stack.tokens_per_s(b, min_time_s) for b in batches}
        kvb = shape.kv_bytes_per_token(elem)
        derived = {b: roofline_tps(b, stack.weight_bytes, bandwidth, model_gflops, shape.flops_per_token,
                                   kvb, context_len) for b in batches}
        per_dtype[name] = {
            "matmul_gflops_by_shape": {n: round(r, 1) for n, r in rates.items()},
            "matmul_gflops_model": round(model_gflops, 1),
            "weight_bytes": stack.weight_bytes,
            "compute_ceiling_tokens_per_s": round(model_gflops * 1e9 / shape.flops_per_token, 1),
            "memory_ceiling_tokens_per_s_batch1": round(bandwidth * 1e9 / stack.weight_bytes, 1),
            "matmul_stack_tokens_per_s": {str(b): round(v, 1) for b, v in measured.items()},
            "roofline_tokens_per_s": {str(b): round(v, 1) for b, v in derived.items()},
        }
        del stack
    return {"copy_bandwidth_gbs": round(bandwidth, 2), "context_len": context_len,
            "model": {**asdict(shape), "num_matmul_params": shape.num_matmul_params,
                      "flops_per_token": shape.flops_per_token},
            "batches": batches, "dtypes": per_dtype}


def engine_fraction(engine: dict, result: dict) -> dict:
    """The engine's rate as fractions of the compute ceiling and of the matmul stack at the largest batch."""
    d = result["dtypes"].get(engine["dtype"])
    if d is None:
        return {}
    largest = str(max(result["batches"]))
    frac = {"engine": engine,
            "fraction_of_compute_ceiling_total_tokens": engine["total_tokens_per_s"] / d["compute_ceiling_tokens_per_s"],
            "fraction_of_matmul_stack_total_tokens": engine["total_tokens_per_s"] / d["matmul_stack_tokens_per_s"][largest]}
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in frac.items()}


def plot(result: dict, path: Path) -> None:
    """Tokens/s vs batch on log-log axes: measured matmul stack, roofline, engine."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bs = result["batches"]
    for (name, d), color in zip(result["dtypes"].items(), ["tab:blue", "tab:orange", "tab:green"]):
        ax.plot(bs, [d["matmul_stack_tokens_per_s"][str(b)] for b in bs], "o-", color=color,
                label=f"{name}: measured matmul stack")
        ax.plot(bs, [d["roofline_tokens_per_s"][str(b)] for b in bs], "--", color=color,
                label=f"{name}: roofline (copy BW, matmul rate)")
    eng = result.get("engine")
    if eng:
        ax.axhline(eng["engine"]["total_tokens_per_s"], color="k", lw=1,
                   label=f"pagedllm ({eng['engine']['dtype']}), prompt+output tok/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch (sequences)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"SmolLM2-135M decode ceiling, {result.get('cpu', 'this machine')}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16, float16")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128,256", help="comma-separated decode batch sizes")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    p.add_argument("--context-len", type=int, default=0,
                   help="mean context per sequence whose K/V a decode step reads (0 = weights only)")
    p.add_argument("--min-time", type=float, default=0.5, help="seconds of repeats per measurement")
    p.add_argument("--copy-mib", type=int, default=512, help="size of the bandwidth copy in MiB")
    p.add_argument("--engine-tps", type=float, default=None,
                   help="the engine's prompt+output tokens/s to place against the ceiling")
    p.add_argument("--engine-dtype", default="float32", help="dtype of --engine-tps")
    p.add_argument("--engine-json", type=Path, default=None, help="a throughput.py JSON record to read the engine's rate from")
    p.add_argument("--workload", default=None, metavar="PROMPT,OUTPUT",
                   help="prompt and output token totals of a workload: its matmul-bound ceiling in output tok/s "
                        "per dtype (e.g. 16384,4096: vLLM's served benchmark of 64 x 256 in / 64 out)")
    p.add_argument("--quick", action="store_true", help="tiny run: batches 1,16,64, short timings")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/roofline.json)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        batches, args.min_time, args.copy_mib = [1, 16, 64], 0.1, 128
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"--dtypes: unknown dtype {d!r} (choose from {', '.join(DTYPES)})")
    result = measure(dtypes, batches, args.min_time, args.copy_mib * 2**20, SMOLLM2_135M, args.context_len)
    result["threads"] = torch.get_num_threads()
    engine = None
    if args.engine_tps is not None:
        engine = {"output_tokens_per_s": None, "total_tokens_per_s": args.engine_tps,
                  "dtype": args.engine_dtype, "source": "--engine-tps"}
    elif args.engine_json is not None:
        engine = load_engine_tps(args.engine_json)
    if engine:
        result["engine"] = engine_fraction(engine, result)
    if args.workload:
        prompt_tokens, output_tokens = (int(v) for v in args.workload.split(","))
        for d in result["dtypes"].values():
            d["workload_ceiling"] = workload_ceiling(prompt_tokens, output_tokens, SMOLLM2_135M,
                                                     d["matmul_gflops_model"])
    path = common.write_result("roofline", result, args.out)
    if not args.no_plot:
        result["cpu"] = common.machine_info()["cpu"]
        plot(result, common.plot_path(path))

    parts = [f"copy {result['copy_bandwidth_gbs']:.1f} GB/s"]
    for name, d in result["dtypes"].items():
        parts.append(f"{name}: matmul {d['matmul_gflops_model']:.0f} GFLOP/s, compute ceiling "
                     f"{d['compute_ceiling_tokens_per_s']:.0f} tok/s, matmul stack @B={max(batches)} "
                     f"{d['matmul_stack_tokens_per_s'][str(max(batches))]:.0f} tok/s, @B=1 "
                     f"{d['matmul_stack_tokens_per_s'][str(min(batches))]:.0f} tok/s")
        if "workload_ceiling" in d:
            parts.append(f"workload ceiling {d['workload_ceiling']['max_output_tokens_per_s']:.0f} output tok/s")
    if result.get("engine"):
        e = result["engine"]
        parts.append(f"engine {e['engine']['total_tokens_per_s']:.0f} tok/s = "
                     f"{100 * e['fraction_of_compute_ceiling_total_tokens']:.0f}% of the {e['engine']['dtype']} compute ceiling")
    print("roofline: " + "; ".join(parts) + f" ({torch.get_num_threads()} threads) -> {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
