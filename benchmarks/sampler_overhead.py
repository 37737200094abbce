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
(``logit = -zipf_s * ln(rank)``, randomly permuted over the vocabulary), so nucleus sizes
resemble real next-token distributions (``--zipf-s`` makes them flatter or sharper).
The reference is one decode step's weight matmuls of SmolLM2-135M at the same batch
(``roofline.MatmulStack``, float32): a lower bound on the forward pass, so the reported
fraction is an upper bound on the sampler's share of a step.

    python benchmarks/sampler_overhead.py            # ~20 s
    python benchmarks/sampler_overhead.py --batch 8 --zipf-s 1.5
"""

from __future__ import annotations

import argparse
import sys
import time

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


def time_scenario(name: str, batch: int, vocab: int, zipf_s: float, repeats: int) -> dict:
    """Best-of-``repeats`` milliseconds of build and of the sampler for one scenario."""
    gen = torch.Generator().manual_seed(0)
    params = scenario_params(name, batch)
    prompts = [torch.randint(17, vocab, (256,), generator=gen).tolist() for _ in range(batch)]
    outputs = [torch.randint(17, vocab, (128,), generator=gen).tolist() for _ in range(batch)]
    logits = zipf_logits(batch, vocab, zipf_s, gen)
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
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sampler_overhead.json)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    scenarios = {name: time_scenario(name, args.batch, args.vocab, args.zipf_s, args.repeats)
                 for name in ("greedy", "random", "penalties", "logprobs")}
    stack = roofline.MatmulStack(roofline.ModelShape(), torch.float32)
    forward_ms = roofline._time(lambda: stack.step(args.batch), min_time_s=1.0, warmup=1) * 1e3
    for rec in scenarios.values():
        rec["fraction_of_matmuls"] = round(rec["total_ms"] / forward_ms, 4)

    record = {"batch": args.batch, "vocab": args.vocab, "zipf_s": args.zipf_s, "repeats": args.repeats,
              "reference_matmul_step_ms": round(forward_ms, 3), "scenarios": scenarios}
    path = common.write_result("sampler_overhead", record, args.out)
    line = ", ".join(f"{k} {v['total_ms']:.1f} ms ({100 * v['fraction_of_matmuls']:.0f}%)" for k, v in scenarios.items())
    print(f"sampler_overhead batch={args.batch} vocab={args.vocab}: {line} of a {forward_ms:.1f} ms "
          f"decode-step matmul stack -> {path.relative_to(common.REPO_ROOT)}")
    return record


if __name__ == "__main__":
    main()
