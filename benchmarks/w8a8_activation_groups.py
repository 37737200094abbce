"""W8A8's activation group size against perplexity on SmolLM2: ``quantization="w8a8"`` with one activation scale
per token and per group of 32 / 64 / 96 / 128 / 192 input features (the C kernel's own numerics: a last group
shorter than the others where the size does not divide a layer), perplexity on the fixed texts of
``benchmarks/quantization.py`` against float32, and greedy agreement over 64 tokens on its 16 chat prompts. The
measurement behind ``pagedllm.quantization.w8a8.ACTIVATION_GROUP``.

    .venv/bin/python benchmarks/w8a8_activation_groups.py [--groups 0 32 64 128]   (0: per token)
"""

from __future__ import annotations

import argparse
import gc

import pagedllm  # noqa: F401  before torch (OpenMP wait policy)

import quantization as qb
from bf16_accuracy import QUESTIONS
from common import RESULTS_DIR, write_result
from pagedllm.quantization import w8a8


def run(config: str, group: int | None) -> dict:
    """Perplexities and greedy tokens of one configuration (``group`` for W8A8's activations; None per token)."""
    w8a8.ACTIVATION_GROUP = group  # read by W8A8Config when the LLM builds its layers
    llm = qb.make_llm(config, "256MiB")
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    out = qb.accuracy_run(llm, convs, 64)
    del llm
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[0, 32, 64, 96, 128, 192])
    ap.add_argument("--out", default=str(RESULTS_DIR / "w8a8_activation_groups.json"))
    args = ap.parse_args()
    default = w8a8.ACTIVATION_GROUP
    ref = run("float32", default)
    rows = {}
    for g in args.groups:
        r = run("w8a8", g or None)
        agree, identical = qb.agreement(ref["tokens"], r["tokens"])
        rows["per token" if g == 0 else str(g)] = row = {
            "perplexity": r["perplexity"], "vs_float32": r["perplexity"] / ref["perplexity"] - 1,
            "perplexity_short_text": r["perplexity_short_text"],
            "short_text_vs_float32": r["perplexity_short_text"] / ref["perplexity_short_text"] - 1,
            "greedy_prefix_agreement": agree, "prompts_identical": identical}
        print(f"group {g or 'per token':>9}: ppl {row['perplexity']:.3f} ({row['vs_float32']:+.1%}), short text "
              f"{row['perplexity_short_text']:.3f} ({row['short_text_vs_float32']:+.1%}), greedy agreement "
              f"{agree:.3f} ({identical}/16 identical)", flush=True)
    out = write_result("w8a8_activation_groups", {
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (dequantized to float32, then W8A8)", "default_group": default,
        "float32": {"perplexity": ref["perplexity"], "perplexity_short_text": ref["perplexity_short_text"]},
        "groups": rows}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
