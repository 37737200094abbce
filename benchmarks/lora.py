"""Multi-LoRA throughput: 32 requests spread over 1, 4 and 16 rank-16 adapters (every projection) in
the same batches, against the same requests on the base model and against the naive alternative (one
adapter at a time: its delta merged into the weights, its requests run, the delta taken out again).

One engine (``enable_lora``, ``max_loras`` 16, prefix caching off so no mode reads another's blocks)
runs every mode; ``--rounds`` rounds alternate the order of the modes. Each mode: ``--requests``
prompts of ``--prompt-len`` random tokens, ``--max-tokens`` greedy output tokens each (EOS ignored),
all added at once; output tok/s is output tokens over the wall time of the whole run (prefill
included; the naive mode's merges included). Reports the median over rounds and the ratios to the
base model and to the naive mode. One result line; JSON to benchmarks/results/lora.json.

    .venv/bin/python benchmarks/lora.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import numpy as np
import torch
from safetensors.torch import save_file

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm import envs

sys.path.insert(0, str(Path(__file__).parent))
from common import FIRST_ORDINARY_TOKEN_ID, write_result  # noqa: E402

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(folder: Path, hf_config, rank: int, seed: int) -> Path:
    """A PEFT folder: random A and B on every projection of every layer, lora_alpha = 2 r."""
    g = torch.Generator().manual_seed(seed)
    h, inter = hf_config.hidden_size, hf_config.intermediate_size
    hd = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * hd, hf_config.num_key_value_heads * hd
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "down_proj": (inter, h)}
    tensors = {}
    for i in range(hf_config.num_hidden_layers):
        for block, names in PROJECTIONS.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                stem = f"base_model.model.model.layers.{i}.{block}.{name}"
                tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
                tensors[f"{stem}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sum(PROJECTIONS.values(), ()),
        "bias": "none"}))
    return folder


def run(llm: LLM, prompts: list[list[int]], loras: list, max_tokens: int) -> float:
    """Output tokens per second of all ``prompts`` added at once, each under its adapter (None: base)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def merge(llm: LLM, lora: LoRARequest, sign: float) -> None:
    """Add (sign 1) or take out (-1) an adapter's ``B A`` in the base weights, then pack them again."""
    from pagedllm.lora.adapter import load_adapter

    runner = llm.llm_engine.runner
    manager = runner.lora_manager
    model = runner.model
    modules = dict(model.named_modules())
    adapter = load_adapter(lora, manager.targets, manager.max_lora_rank, torch.float32)
    model.unpack_linears()
    with torch.no_grad():
        for hf_path, w in adapter.modules.items():
            target = manager.targets[hf_path]
            module = modules[target.module_path]
            rows = module.weight if target.shard is None else module.shard(module.weight, target.shard)
            rows.add_((w.lora_b @ w.lora_a).to(rows.dtype), alpha=sign)
    if envs.cpu_packed_linear():
        model.pack_linears_for_cpu(bf16_math=envs.cpu_fp32_matmul_in_bf16())


def run_naive(llm: LLM, prompts: list[list[int]], loras: list, max_tokens: int) -> float:
    """One adapter at a time: merged, its requests run as base-model requests, unmerged."""
    t0, num_tokens = time.perf_counter(), 0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for lora in dict.fromkeys(loras):
        mine = [{"prompt_token_ids": p} for p, r in zip(prompts, loras) if r == lora]
        merge(llm, lora, 1.0)
        outs = llm.generate(mine, params, use_tqdm=False)
        merge(llm, lora, -1.0)
        num_tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return num_tokens / (time.perf_counter() - t0)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", default="1,4,16", help="distinct adapters per mix")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.adapters.split(",")]
    llm = LLM(model=args.model, enable_lora=True, max_loras=max(counts), max_lora_rank=args.rank,
              max_cpu_loras=max(counts), enable_prefix_caching=False, seed=0)
    hf_config = llm.llm_engine.model_files.hf_config
    tmp = Path(tempfile.mkdtemp(prefix="pagedllm-lora-bench-"))
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(tmp / f"a{i}", hf_config, args.rank, seed=i)))
                for i in range(max(counts))]
    rng = np.random.default_rng(0)
    modes = {"base": lambda p: run(llm, p, [None] * len(p), args.max_tokens)}
    for c in counts:
        mix = [adapters[i % c] for i in range(args.requests)]
        modes[f"lora_{c}"] = lambda p, mix=mix: run(llm, p, mix, args.max_tokens)
    naive_mix = [adapters[i % max(counts)] for i in range(args.requests)]
    modes[f"naive_merged_{max(counts)}"] = lambda p: run_naive(llm, p, naive_mix, args.max_tokens)
    warm = [[int(t) for t in rng.integers(FIRST_ORDINARY_TOKEN_ID, 49152, args.prompt_len)] for _ in range(4)]
    run(llm, warm, [None, adapters[0], None, adapters[-1]], 4)  # warm-up: kernels, graphs, slots
    tok_s: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        prompts = [[int(t) for t in rng.integers(FIRST_ORDINARY_TOKEN_ID, 49152, args.prompt_len)]
                   for _ in range(args.requests)]
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for mode in order:
            tok_s[mode].append(modes[mode](prompts))
            print(f"round {r} {mode}: {tok_s[mode][-1]:.1f} tok/s", flush=True)
    median = {m: statistics.median(v) for m, v in tok_s.items()}
    naive = median[f"naive_merged_{max(counts)}"]
    ratios = {m: {"vs_base": round(v / median["base"], 3), "vs_naive": round(v / naive, 3)} for m, v in median.items()}
    path = write_result("lora", {"settings": vars(args), "output_tok_s": tok_s, "median_output_tok_s": median,
                                 "ratios": ratios}, args.out)
    print(" ".join(f"{m} {v:.1f} tok/s ({ratios[m]['vs_base']:.2f}x base, {ratios[m]['vs_naive']:.2f}x naive)"
                   for m, v in median.items()) + f" -> {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
