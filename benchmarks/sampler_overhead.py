"""Sampler cost per engine step at batch 64 over SmolLM2's vocabulary (49,152 tokens).

Times ``SamplingMetadata.build`` (host-side batching of the parameters) and ``Sampler``
(one batched pass over float32 logits [64, 49152]) for four batches:

- ``greedy``: temperature 0 everywhere (argmax only);
- ``random``: a mix of temperature + top-k 50 + top-p 0.9, temperature + top-p 0.95 (no
  top-k), plain temperature, and min-p 0.05 rows, half of them seeded;
- ``penalties``: greedy with repetition 1.1, frequency 0.5, presence 0.3 over 256 prompt
  and 128 output tokens per row;
- ``logprobs``: the ``random`` mix with ``logprobs=5`` on every row.

Logits are synthetic but shaped like a language model's: each row is Zipfian
(``logit = -zipf_s * ln(rank)``, randomly permuted over the vocabulary); s = 1.2 is
flatter than SmolLM2 usually is (its 0.95-nucleus at temperature 1 has a median of ~120
tokens, this one ~8,000), so top-p costs are pessimistic. ``--real-logits`` uses
SmolLM2-135M's own next-token logits on fixed prompts instead.
The reference is one decode step's weight matmuls of SmolLM2-135M at the same batch
(``roofline.MatmulStack``, float32): a lower bound on the forward pass, so the reported
fraction is an upper bound on the sampler's share of a step.

    python benchmarks/sampler_overhead.py                 # ~20 s
    python benchmarks/sampler_overhead.py --real-logits   # + ~40 s to load the model
    python benchmarks/sampler_overhead.py --batch 8 --zipf-s 1.5
    python benchmarks/sampler_overhead.py --quick         # smoke run, ~1 s
"""

from __future__ import annotations

import argparse
import sys
import time

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

import common
import roofline

sys.path.insert(0, str(common.REPO_ROOT))  # run from a checkout without installing

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler  # noqa: E402
from pagedllm.worker.sampling_metadata import SamplingMetadata

EOS = 2


def zipf_logits(batch: int, vocab: int, s: float, gen: torch.Generator) -> torch.Tensor:
    """float32 [batch, vocab]: row i is ``-s * ln(rank)`` over a random permutation of the vocab."""
    base = -s * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    perm = torch.argsort(torch.rand(batch, vocab, generator=gen), dim=-1)
    return base[perm] + 0.01 * torch.randn(batch, vocab, generator=gen)


PROMPTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre and its cafes, and",
    "Once upon a time, there was a little fox who lived at the edge of a great forest. Every morning she",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef main():\n",
    "I think the best way to learn a new language is to practise every day, read books you enjoy and",
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\nThe waves",
    "Here are some ideas for a quick dinner: pasta with tomato sauce, a vegetable stir-fry, or",
    "The results of the experiment show that the new method reduces the error rate by almost half, which",
    "My favourite colour is green because it reminds me of the countryside where I grew up, and",
]


def smollm2_logits(batch: int) -> torch.Tensor:
    """float32 [batch, 49152]: SmolLM2-135M's next-token logits at the last positions of PROMPTS.

    Teacher-forced (one forward pass per prompt), so every row is a real next-token
    distribution; loading the model takes ~40 s on a busy 2-core machine.
    """
    from throughput import default_gguf
    from pagedllm.loader import load_model_files
    gguf = default_gguf()
    model, _ = common.load_hf_model(gguf)
    tok = load_model_files(gguf).tokenizer
    per_prompt = -(-batch // len(PROMPTS))
    rows = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = torch.tensor([tok.encode(text)])
            rows.append(model(ids).logits[0, -per_prompt:].float())
    return torch.cat(rows)[:batch].contiguous()


def scenario_params(name: str, batch: int) -> list[SamplingParams]:
    """The SamplingParams of each row of one scenario (see the module docstring)."""
    if name == "greedy":
        return [SamplingParams(temperature=0.0) for _ in range(batch)]
    if name == "penalties":
        return [SamplingParams(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.3)
                for _ in range(batch)]
    mix = [dict(temperature=0.8, top_k=50, top_p=0.9), dict(temperature=1.0, top_p=0.95),
           dict(temperature=0.7), dict(temperature=1.0, min_p=0.05)]
    extra = dict(logprobs=5) if name == "logprobs" else {}
    return [SamplingParams(**mix[i % 4], seed=(i if i % 2 else None), **extra) for i in range(batch)]


def time_scenario(name: str, logits: torch.Tensor, repeats: int) -> dict:
    """Best-of-``repeats`` milliseconds of build and of the sampler for one scenario on ``logits`` [B, V]."""
    batch, vocab = logits.shape
    gen = torch.Generator().manual_seed(0)
    params = scenario_params(name, batch)
    prompts = [torch.randint(17, vocab, (256,), generator=gen).tolist() for _ in range(batch)]
    outputs = [torch.randint(17, vocab, (128,), generator=gen).tolist() for _ in range(batch)]
    sampler = Sampler()
    build_ms, sample_ms = [], []
    for r in range(repeats + 1):  # the first round is the warm-up
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        x = logits.clone()
        t0 = time.perf_counter()
        md = SamplingMetadata.build(params, prompts, outputs, gens, [EOS] * batch, vocab, "cpu")
        t1 = time.perf_counter()
        out = sampler(x, md)
        t2 = time.perf_counter()
        if r:
            build_ms.append((t1 - t0) * 1e3)
            sample_ms.append((t2 - t1) * 1e3)
    assert out.sampled_token_ids.shape == (batch,)
    return {"build_ms": round(min(build_ms), 3), "sample_ms": round(min(sample_ms), 3),
            "total_ms": round(min(b + s for b, s in zip(build_ms, sample_ms)), 3)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=common.SMOLLM2_VOCAB_SIZE)
    ap.add_argument("--zipf-s", type=float, default=1.2, help="Zipf exponent of the synthetic logits")
    ap.add_argument("--real-logits", action="store_true",
                    help="use SmolLM2-135M's next-token logits on fixed prompts instead (loads the model)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sampler_overhead.json)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: batch 8, vocab 4096, 1 repeat, no matmul reference")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.vocab, args.repeats, args.real_logits = 8, 4096, 1, False
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    if args.real_logits:
        logits, source = smollm2_logits(args.batch), "smollm2-135m next-token logits"
    else:
        logits = zipf_logits(args.batch, args.vocab, args.zipf_s, torch.Generator().manual_seed(0))
        source = f"zipf s={args.zipf_s}"
    scenarios = {name: time_scenario(name, logits, args.repeats)
                 for name in ("greedy", "random", "penalties", "logprobs")}
    forward_ms = None
    if not args.quick:
        stack = roofline.MatmulStack(roofline.ModelShape(), torch.float32)
        forward_ms = roofline._time(lambda: stack.step(args.batch), min_time_s=1.0, warmup=1) * 1e3
    for rec in scenarios.values():
        rec["fraction_of_matmuls"] = round(rec["total_ms"] / forward_ms, 4) if forward_ms else None

    record = {"batch": args.batch, "vocab": logits.shape[1], "logits": source, "repeats": args.repeats,
              "threads": torch.get_num_threads(),
              "reference_matmul_step_ms": round(forward_ms, 3) if forward_ms else None, "scenarios": scenarios}
    path = common.write_result("sampler_overhead", record, args.out)
    line = ", ".join(f"{k} {v['total_ms']:.1f} ms" + (f" ({100 * v['fraction_of_matmuls']:.0f}%)" if forward_ms else "")
                     for k, v in scenarios.items())
    ref = f" of a {forward_ms:.1f} ms decode-step matmul stack" if forward_ms else ""
    print(f"sampler_overhead batch={args.batch} vocab={logits.shape[1]} ({source}, {torch.get_num_threads()} threads): "
          f"{line}{ref} -> {path}")
    return record


if __name__ == "__main__":
    main()
