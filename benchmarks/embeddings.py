"""Sentence embeddings: pagedllm's pooling runner (``LLM.embed``) vs sentence-transformers' ``encode``.

The same all-MiniLM-L6-v2 folder (the ``all-minilm-l6-v2`` alias), float32 on CPU, the same torch
threads, one process. The corpus: ``--num-sentences`` (2,000) sentences of words drawn from the
model's vocabulary, lengths uniform in 5..250 tokens ([CLS] and [SEP] included), fixed seed.
sentence-transformers runs with its default batch size (32, batches sorted by length, padded);
pagedllm packs sentences without padding up to its token budget. The two alternate for
``--rounds`` rounds; medians of sentences/s are reported, with the smallest cosine between the two
embeddings of a sentence.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/embeddings.py             # ~2,000 sentences x 2 x rounds
    python benchmarks/embeddings.py --num-sentences 200 --rounds 1      # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import numpy as np
import torch

import common

sys.path.insert(0, str(common.REPO_ROOT))

from pagedllm import LLM  # noqa: E402
from pagedllm.loader import resolve_model  # noqa: E402

MODEL = "all-minilm-l6-v2"


def corpus(tokenizer, n: int, seed: int, lo: int = 5, hi: int = 250) -> list[str]:
    """``n`` sentences of whole vocabulary words, each ``lo..hi`` tokens long with its special tokens."""
    rng = np.random.default_rng(seed)
    words = [w for w, i in tokenizer.get_vocab().items() if i >= 1996 and w.isalpha()]
    sentences = []
    for target in rng.integers(lo, hi + 1, n):
        picked = [words[i] for i in rng.integers(0, len(words), target)]
        while len(tokenizer(" ".join(picked))["input_ids"]) > target and len(picked) > 1:
            picked.pop()
        sentences.append(" ".join(picked))
    return sentences


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-sentences", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(resolve_model(MODEL).path), device="cpu")
    llm = LLM(MODEL)
    sentences = corpus(llm.get_tokenizer(), args.num_sentences, args.seed)
    lens = [len(ids) for ids in llm.get_tokenizer()(sentences)["input_ids"]]
    llm.embed(sentences[:64]), st.encode(sentences[:64])  # warm-up
    rates = {"pagedllm": [], "sentence_transformers": []}
    for _ in range(args.rounds):
        seconds, ours = timed(lambda: torch.tensor([o.outputs.embedding for o in llm.embed(sentences)]))
        rates["pagedllm"].append(len(sentences) / seconds)
        seconds, theirs = timed(lambda: torch.from_numpy(st.encode(sentences)))
        rates["sentence_transformers"].append(len(sentences) / seconds)
    cosine = float(torch.nn.functional.cosine_similarity(ours, theirs).min())
    median = {k: statistics.median(v) for k, v in rates.items()}
    ratio = median["pagedllm"] / median["sentence_transformers"]
    record = {"model": MODEL, "num_sentences": len(sentences), "tokens_total": sum(lens),
              "tokens_min_max": [min(lens), max(lens)], "rounds": args.rounds, "torch_threads": torch.get_num_threads(),
              "sentences_per_s": rates, "median_sentences_per_s": median, "ratio": ratio, "min_cosine": cosine,
              "max_abs_diff": float((ours - theirs).abs().max())}
    path = common.write_result("embeddings", record, args.out)
    print(f"embeddings: pagedllm {median['pagedllm']:.1f} sent/s vs sentence-transformers "
          f"{median['sentence_transformers']:.1f} sent/s = {ratio:.2f}x, min cosine {cosine:.6f} "
          f"({len(sentences)} sentences, {torch.get_num_threads()} threads) -> {path}")


if __name__ == "__main__":
    main()
