"""Pre-quantized checkpoints of SmolLM2: accuracy of each format against the float32 folder they came from.

The GGUF's weights, dequantized to float32, are written as a Hugging Face folder (the reference),
then quantized by compressed-tensors (W4A16 with zero points and symmetric, group 32; W8A8 per
channel; W8A16 group 32) and packed as GPTQ (4-bit, group 32, with zero points) and AWQ (GEMM,
group 32) with the test writers (``tests/quantization/checkpoint_writers.py``: min-max rounding,
the formats' own packing). Each folder loads in pagedllm as stored. Measured against the float32
folder: greedy agreement over ``--max-tokens`` tokens on 16 chat prompts (share of positions
before the first divergence, prompts identical end to end), perplexity on the fixed local text,
and the max |logit difference| at the prompts' last position. One line per format and a JSON
record (benchmarks/results/prequantized_accuracy.json). W8A8 runs on the weight-only int8 method
until the W8A8 kernel takes its weights (activations stay float).

    .venv/bin/python benchmarks/prequantized_accuracy.py [--max-tokens 32] [--formats ...]
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import torch

from bf16_accuracy import QUESTIONS
from common import REPO_ROOT, RESULTS_DIR, write_result
from quantization import accuracy_run, agreement
from pagedllm import LLM

sys.path.insert(0, str(REPO_ROOT))
from tests.conftest import smollm2_gguf_path  # noqa: E402
from tests.quantization.checkpoint_writers import (write_compressed_tensors_folder, write_hf_folder_from_gguf,  # noqa: E402
                                                   write_packed_folder)

# name -> how the folder is written from the float32 one
FORMATS = {
    "ct-w4a16-asym-g32": lambda src, dst: write_compressed_tensors_folder(src, dst, "W4A16_ASYM", 32),
    "ct-w4a16-sym-g32": lambda src, dst: write_compressed_tensors_folder(src, dst, "W4A16", 32),
    "ct-w8a8": lambda src, dst: write_compressed_tensors_folder(src, dst, "W8A8"),
    "ct-w8a16-g32": lambda src, dst: write_compressed_tensors_folder(src, dst, "W8A16", 32),
    "gptq-4bit-g32": lambda src, dst: write_packed_folder(src, dst, "gptq", 32, symmetric=False)[0],
    "awq-4bit-g32": lambda src, dst: write_packed_folder(src, dst, "awq", 32)[0],
}


def run(folder: Path, convs: list, max_tokens: int) -> dict:
    llm = LLM(model=str(folder), max_model_len=2560, kv_cache_memory="256MiB")  # the 2215-token perplexity text
    result = accuracy_run(llm, convs, max_tokens)
    result["weight_bytes"] = llm.llm_engine.runner.weight_bytes()
    del llm
    gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--out", default=str(RESULTS_DIR / "prequantized_accuracy.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    with tempfile.TemporaryDirectory() as tmp:
        src = write_hf_folder_from_gguf(smollm2_gguf_path(), Path(tmp) / "float32")
        ref = run(src, convs, args.max_tokens)
        print(f"{'float32':>18}: ppl {ref['perplexity']:.3f}, weights {ref['weight_bytes'] / 2**20:.1f} MiB")
        results = {"float32": {"perplexity": ref["perplexity"], "weight_bytes": ref["weight_bytes"]}}
        for name in args.formats:
            got = run(FORMATS[name](src, Path(tmp) / name), convs, args.max_tokens)
            share, identical = agreement(ref["tokens"], got["tokens"])
            results[name] = {"perplexity": got["perplexity"], "weight_bytes": got["weight_bytes"],
                             "greedy_prefix_agreement": share, "prompts_identical": identical,
                             "max_abs_logit_diff": float((got["logits"] - ref["logits"]).abs().max())}
            print(f"{name:>18}: ppl {got['perplexity']:.3f}, greedy agreement {share:.3f} ({identical}/16 "
                  f"identical), max |dlogit| {results[name]['max_abs_logit_diff']:.3f}, "
                  f"weights {got['weight_bytes'] / 2**20:.1f} MiB")
    record = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32, then quantized per format)",
              "greedy_tokens": args.max_tokens, "num_prompts": len(convs), "formats": results}
    print(f"wrote {write_result('prequantized_accuracy', record, args.out)}")


if __name__ == "__main__":
    main()
