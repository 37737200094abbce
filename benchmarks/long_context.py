"""Long prompts: prefill speed of pagedllm vs transformers' ``generate`` on the same token ids.

For each prompt length (default 2,048, 4,096 and 8,160 tokens: SmolLM2 holds 8,192
positions), both systems get the same seeded random prompt, generate ``--new-tokens``
greedy tokens (EOS ignored), and are timed one after the other (the order alternates
between lengths, the machine is shared). Per system and length:

- prefill seconds: pagedllm's time from adding the request until its first token comes out
  of the engine's step loop (its engine defaults: chunked prefill under the 2,048-token step
  budget); transformers' time until its logits processor first runs (the whole prompt in
  one forward, SDPA attention, logits of the last position only);
- prefill CPU seconds: the process's CPU time (all threads) over the same span, steadier than
  wall time on a shared machine (with ``--threads 1``: the 1-thread CPU time);
- total seconds (prefill + the remaining tokens);
- peak RSS above the process's RSS just before the call (sampled every 5 ms; the
  KV cache of pagedllm is allocated at start-up and not counted);
- whether the greedy tokens equal transformers';
- the 1-minute load average before the run.

``--dtype bfloat16`` runs both systems' models in bfloat16; ``--fp32-matmul bf16`` gives
pagedllm's float32 model the opt-in bfloat16 math in its linears (``PAGEDLLM_CPU_FP32_MATMUL``;
transformers stays float32), so greedy agreement then measures that opt-in's accuracy.
``--repeats N`` times each length N times per system, alternating (medians recorded, the
ratio of medians and the per-repeat ratios).

With ``--profile`` each system also prefills each length once more (one new token) under
torch's profiler, and the record gets the op-level split of that prefill: matmuls (oneDNN /
MKL GEMMs), attention (SDPA kernels; pagedllm's prefill attention as one labelled range,
since its C kernel is not a torch op) and everything else (the profiled run's wall time minus
those two: norms, rotary, SiLU, residual adds, KV writes, embedding, Python), as seconds of
wall time on the calling thread and shares.

One result line; JSON to ``benchmarks/results/long_context.json``.

    .venv/bin/python benchmarks/long_context.py
    .venv/bin/python benchmarks/long_context.py --lengths 2048 --systems pagedllm
    .venv/bin/python benchmarks/long_context.py --lengths 2048,8160 --profile --new-tokens 1 \
        --out benchmarks/results/long_context_profile.json
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

import common

sys.path.insert(0, str(common.REPO_ROOT))

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRss:
    """Context manager: ``peak_above_start`` = max RSS seen while inside minus RSS at entry (bytes)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.peak_above_start = 0

    def __enter__(self) -> "PeakRss":
        self._start = rss_bytes()
        self._peak = self._start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_above_start = max(self._peak, rss_bytes()) - self._start


_MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise",
               "pagedllm::skinny_gemm"}  # the engine's decode-row linears (pagedllm/ops/skinny_gemm.py)
_ATTENTION_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                  "pagedllm::prefill_attention"}


def profile_split(run) -> dict:
    """Run ``run()`` under torch's profiler: its wall time on the calling thread split into the
    self time of its matmul ops, of its attention ops and the rest (``other_s``: every other
    op, the fused C kernels called through ctypes, which are no torch ops, and Python), in
    seconds and as shares of the total."""
    import torch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run()
        total = time.perf_counter() - t0
    split = {"matmul_s": 0.0, "attention_s": 0.0}
    for e in prof.key_averages():
        kind = "matmul_s" if e.key in _MATMUL_OPS else "attention_s" if e.key in _ATTENTION_OPS else None
        if kind:
            split[kind] += e.self_cpu_time_total / 1e6
    split["other_s"] = max(0.0, total - split["matmul_s"] - split["attention_s"])
    split = {k: round(v, 3) for k, v in split.items()}
    split.update({k.replace("_s", "_share"): round(v / total, 3) for k, v in list(split.items())})
    return split


class PagedLLM:
    name = "pagedllm"

    def __init__(self, max_model_len: int, engine_kwargs: dict, dtype: str = "float32") -> None:
        from pagedllm import LLM
        self.llm = LLM(model="smollm2-135m-instruct", dtype=dtype, max_model_len=max_model_len, seed=0,
                       **engine_kwargs)
        cfg = self.llm.llm_engine.config
        self.info = {"token_budget": cfg.token_budget, "enable_chunked_prefill": cfg.enable_chunked_prefill,
                     "kv_cache": self.llm.llm_engine.kv_cache_spec.describe(),
                     "attention_backend": type(self.llm.llm_engine.runner.model.model.layers[0].self_attn.attn.backend).__name__}

    def label_prefill_attention(self) -> None:
        """Make the backend's prefill attention one labelled profiler range (its C kernel is not a torch op)."""
        import torch
        impl_cls = type(self.llm.llm_engine.runner.model.model.layers[0].self_attn.attn.impl)  # every layer's
        prefill = impl_cls._prefill

        def labelled(*args, **kwargs):
            with torch.profiler.record_function("pagedllm::prefill_attention"):
                return prefill(*args, **kwargs)
        impl_cls._prefill = labelled

    def run(self, prompt: list[int], new_tokens: int) -> dict:
        """The engine's own step loop (what ``LLM.generate`` runs), timed at the first token; the
        prefix cache emptied first, so a repeated prompt is computed again."""
        from pagedllm import SamplingParams
        engine = self.llm.llm_engine
        if not engine.scheduler.reset_prefix_cache():
            raise RuntimeError("pagedllm's prefix cache could not be reset")
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        t0, c0 = time.perf_counter(), time.process_time()
        engine.add_request(None, {"prompt_token_ids": prompt}, params)
        first = final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = (time.perf_counter(), time.process_time())
                if out.finished:
                    final = out
        total = time.perf_counter() - t0
        if final is None or final.error:
            raise RuntimeError(f"pagedllm failed: {final.error if final else 'no output'}")
        return {"prefill_s": first[0] - t0, "prefill_cpu_s": first[1] - c0, "total_s": total,
                "token_ids": list(final.outputs[0].token_ids)}


class Transformers:
    name = "transformers"

    def __init__(self, dtype: str = "float32") -> None:
        import torch
        import transformers
        from pagedllm.loader.resolve import resolve_model
        self.torch = torch
        self.model, source = common.load_hf_model(resolve_model("smollm2-135m-instruct").path, dtype)
        self.info = {"transformers": transformers.__version__, "weights": source, "dtype": dtype,
                     "attn_implementation": self.model.config._attn_implementation}

    def run(self, prompt: list[int], new_tokens: int) -> dict:
        torch = self.torch
        first: list[float] = []

        def mark_first(input_ids, scores):  # a LogitsProcessor: runs once per generated token
            if not first:
                first.extend((time.perf_counter(), time.process_time()))
            return scores

        ids = torch.tensor([prompt])
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            gen = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                      logits_processor=[mark_first])
        total = time.perf_counter() - t0
        return {"prefill_s": first[0] - t0, "prefill_cpu_s": first[1] - c0, "total_s": total,
                "token_ids": gen[0, len(prompt):].tolist()}


def _summarise(runs: list[dict], n: int) -> dict:
    """One system's record for one length: the medians of its repeats' times (the first run's
    tokens; every run's tokens must agree), the largest peak RSS, each run's times and loads."""
    if any(r["token_ids"] != runs[0]["token_ids"] for r in runs):
        raise RuntimeError(f"greedy tokens differ between repeats at {n} tokens")
    out = {k: round(float(np.median([r[k] for r in runs])), 3) for k in ("prefill_s", "prefill_cpu_s", "total_s")}
    out.update(token_ids=runs[0]["token_ids"], peak_rss_above_start_mib=max(r["peak_rss_above_start_mib"] for r in runs),
               prefill_tokens_per_s=round(n / out["prefill_s"], 1),
               load_average_1min_before=[r["load_average_1min_before"] for r in runs])
    if len(runs) > 1:
        out["prefill_s_per_repeat"] = [round(r["prefill_s"], 3) for r in runs]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8160", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--systems", default="pagedllm,transformers")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="pagedllm step budget (default: its own)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="pagedllm: most prompt tokens a long prompt computes per step (default: its own)")
    p.add_argument("--kv-cache-memory", default="1GiB", help="pagedllm's KV pool (8,176 tokens of SmolLM2 need 377 MiB)")
    p.add_argument("--profile", action="store_true", help="also record each prefill's matmul / attention / other split")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both systems' model dtype")
    p.add_argument("--fp32-matmul", default="fp32", choices=["fp32", "bf16"],
                   help="pagedllm's PAGEDLLM_CPU_FP32_MATMUL (bf16: opt-in bfloat16 math in float32 linears)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's own)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per length and system, alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ["PAGEDLLM_CPU_FP32_MATMUL"] = args.fp32_matmul  # read when pagedllm loads its model
    max_model_len = max(lengths) + args.new_tokens
    engine_kwargs = {"kv_cache_memory": args.kv_cache_memory}
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.long_prefill_token_threshold:
        engine_kwargs["long_prefill_token_threshold"] = args.long_prefill_token_threshold
    makers = {"pagedllm": lambda: PagedLLM(max_model_len, engine_kwargs, args.dtype),
              "transformers": lambda: Transformers(args.dtype)}
    systems = [makers[n]() for n in args.systems.split(",")]
    rng = np.random.default_rng(args.seed)
    warm = common.random_prompts(rng, np.array([64]))[0]
    for s in systems:
        s.run(warm, 2)  # first-call allocations, oneDNN primitive creation
        if args.profile and isinstance(s, PagedLLM):
            s.label_prefill_attention()
    results: dict[str, dict] = {s.name: {} for s in systems}
    runs: dict[str, dict[str, list[dict]]] = {s.name: {str(n): [] for n in lengths} for s in systems}
    for i, n in enumerate(lengths):
        prompt = common.random_prompts(rng, np.array([n]))[0]
        for rep in range(args.repeats):
            order = systems if (i + rep) % 2 == 0 else systems[::-1]
            for s in order:
                load = os.getloadavg()[0]
                with PeakRss() as rss:
                    r = s.run(prompt, args.new_tokens)
                r["peak_rss_above_start_mib"] = round(rss.peak_above_start / 2**20, 1)
                r["load_average_1min_before"] = round(load, 2)
                runs[s.name][str(n)].append(r)
                print(f"  {n} tokens, {s.name}: prefill {r['prefill_s']:.2f} s (CPU {r['prefill_cpu_s']:.2f} s), "
                      f"total {r['total_s']:.2f} s, peak RSS +{r['peak_rss_above_start_mib']:.0f} MiB, "
                      f"load {load:.1f}", file=sys.stderr)
        for s in systems:
            results[s.name][str(n)] = r = _summarise(runs[s.name][str(n)], n)
            if args.profile:
                # a fresh prompt of the same length: pagedllm's prefix cache holds the timed one
                other = common.random_prompts(np.random.default_rng(args.seed + n), np.array([n]))[0]
                r["profile"] = profile_split(lambda: s.run(other, 1))
                print(f"  {n} tokens, {s.name}: profiled split {r['profile']}", file=sys.stderr)
    summary = {}
    if {"pagedllm", "transformers"} <= results.keys():
        for n in map(str, lengths):
            a, b = results["pagedllm"][n], results["transformers"][n]
            ra, rb = runs["pagedllm"][n], runs["transformers"][n]
            summary[n] = {"prefill_speedup_vs_transformers": round(b["prefill_s"] / a["prefill_s"], 3),
                          "prefill_cpu_speedup_vs_transformers": round(b["prefill_cpu_s"] / a["prefill_cpu_s"], 3),
                          "total_speedup_vs_transformers": round(b["total_s"] / a["total_s"], 3),
                          "greedy_equal": a["token_ids"] == b["token_ids"]}
            if args.repeats > 1:
                summary[n]["prefill_speedup_per_repeat"] = [round(y["prefill_s"] / x["prefill_s"], 3)
                                                            for x, y in zip(ra, rb)]
    record = {"lengths": lengths, "new_tokens": args.new_tokens, "dtype": args.dtype, "fp32_matmul": args.fp32_matmul,
              "threads": torch.get_num_threads(), "repeats": args.repeats,
              "system_info": {s.name: s.info for s in systems},
              "results": results, "pagedllm_vs_transformers": summary}
    path = common.write_result("long_context", record, args.out)
    parts = [f"{n}: prefill {v['prefill_speedup_vs_transformers']:.2f}x, greedy equal {v['greedy_equal']}"
             for n, v in summary.items()]
    print("long context, pagedllm vs transformers: " + ("; ".join(parts) or "(one system)") + f" -> {path}")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
