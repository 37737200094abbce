"""Speculative decoding (n-gram, suffix, a draft model) against plain decoding on the real default model.

Three workloads from issue #38, each at batch 1, 4 and 16, greedy:

- ``code``: a generated Python file of ``--lines`` lines and an instruction to rename one
  function, the model rewriting the file (batch B: the same file, B different renames);
- ``rag``: a document of about ``--doc-tokens`` tokens of facts and a question whose answer
  quotes it (batch B: the same document, B different questions);
- ``peers``: the peers workload's random prompts (20-200 token ids, no repetition).

For every (workload, batch) the methods run back to back on one engine (one copy of the
weights; its drafter swapped: none, n-gram, suffix, draft model), each with the prefix cache
reset, so they see the same machine load. The draft model is a truncated copy of the target
(``--draft-layers``: the decoder layers it keeps, the same weights; written to a temporary folder),
built once; the time it takes to draft is inside the runs' wall time. Reported per run:
output tok/s (output tokens / wall time), mean TPOT (per request: decode time / (tokens - 1)),
the acceptance rate, the acceptance rate per draft position, and whether every output equals
the plain run's (greedy: it must). The step profile splits the runner's steps into decode-only
and verify steps (median wall time and tokens per step).

    python benchmarks/speculative.py                         # the issue's sizes
    python benchmarks/speculative.py --lines 120 --doc-tokens 800 --max-tokens 96   # shorter
    python benchmarks/speculative.py --methods off draft_model --batches 1 4 --draft-layers 20
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time

import numpy as np

import common

sys.path.insert(0, str(common.REPO_ROOT))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.config import SpeculativeConfig  # noqa: E402
from pagedllm.spec_decode.drafter import Drafter, make_proposer  # noqa: E402

METHODS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 5},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},  # "model": set by main()
}
CITIES = ["Arden", "Belmont", "Corvale", "Dunmore", "Elstree", "Farnham", "Glenrock", "Hollis", "Ivybridge",
          "Jarrow", "Kelso", "Lydford", "Marden", "Norwood", "Oakham", "Penrith", "Quorn", "Redhill"]


def code_file(num_lines: int) -> str:
    lines, i = [], 0
    while len(lines) < num_lines:
        lines += [f"def compute_{i}(values, scale={i % 7 + 1}):", f'    """Weighted sum number {i}."""',
                  "    total = 0", "    for v in values:", f"        total += v * scale + {i}", "    return total", ""]
        i += 1
    return "\n".join(lines[:num_lines])


def rag_document(num_tokens: int, tokenizer) -> str:
    rng = np.random.default_rng(0)
    sentences = []
    while len(tokenizer.encode("\n".join(sentences))) < num_tokens:
        c = CITIES[len(sentences) % len(CITIES)]
        sentences.append(f"Fact {len(sentences) + 1}: the town of {c} recorded {int(rng.integers(1000, 99999))} "
                         f"residents in {int(rng.integers(1900, 2020))}, and its river is {int(rng.integers(5, 300))} km long.")
    return "\n".join(sentences)


def chat_prompts(llm: LLM, messages: list[str]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False)
            for m in messages]


def workloads(llm: LLM, batch: int, args) -> dict[str, tuple[list[list[int]], SamplingParams]]:
    code = code_file(args.lines)
    doc = rag_document(args.doc_tokens, llm.get_tokenizer())
    text = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    peers = common.peers_workload(num_requests=batch, seed=0)
    return {
        "code": (chat_prompts(llm, [f"Here is a Python file:\n\n{code}\n\nRewrite the whole file with compute_{i} "
                                    f"renamed to compute_renamed_{i}. Output only the code." for i in range(batch)]), text),
        "rag": (chat_prompts(llm, [f"Document:\n{doc}\n\nQuote, word for word, every fact of the document about the "
                                   f"town of {CITIES[i % len(CITIES)]}." for i in range(batch)]), text),
        "peers": (peers.prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)),
    }


def new_drafter(method: str, draft_proposers: dict) -> Drafter | None:
    """A fresh drafter (no earlier run's outputs); a draft model's proposer is built once."""
    if METHODS[method] is None:
        return None
    config = SpeculativeConfig(**METHODS[method])
    if method in draft_proposers:
        return Drafter(config, draft_proposers[method])
    return Drafter(config, make_proposer(config))


def draft_model_proposers(llm: LLM, methods: list[str], layers: list[int]) -> dict:
    """``{"draft_model": DraftModelProposer}`` over a truncated copy of the target (``layers``)."""
    if "draft_model" not in methods:
        return {}
    from pagedllm.worker.draft_model import DraftModelProposer
    from tests.model_utils import write_truncated_copy

    engine = llm.llm_engine
    folder = write_truncated_copy(str(engine.config.model), tempfile.mkdtemp(prefix="draft_"), layers)
    METHODS["draft_model"] = {**METHODS["draft_model"], "model": str(folder)}
    spec = SpeculativeConfig(**METHODS["draft_model"])
    return {"draft_model": DraftModelProposer(engine.config, spec, engine.vocab_size, engine.kv_cache_spec.num_blocks)}


def always_draft(drafter: Drafter | None) -> Drafter | None:
    """``drafter`` drafting k tokens for every decoding request (the step-cost rule bypassed):
    the proposer's raw acceptance per position."""
    if drafter is not None:
        k = drafter.config.num_speculative_tokens
        drafter._draft_limits = lambda decoding, step_cost: [k] * len(decoding)
    return drafter


def timed_drafter(drafter: Drafter | None, profile: "StepProfile") -> Drafter | None:
    """``drafter`` whose ``step`` (proposing) is timed into ``profile``."""
    if drafter is not None:
        step = drafter.step

        def timed(*a, **k):
            t0 = time.perf_counter()
            step(*a, **k)
            profile.drafter_s += time.perf_counter() - t0
        drafter.step = timed
    return drafter


class StepProfile:
    """Wall time of the runner's steps by kind: decode-only, verify (drafts), other (prefill)."""

    def __init__(self, llm: LLM) -> None:
        runner = llm.llm_engine.runner
        self.steps: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
        self.drafter_s = 0.0  # proposing, outside the runner's steps
        execute = runner.execute_model

        def timed(so, *a, **k):
            t0 = time.perf_counter()
            out = execute(so, *a, **k)
            kind = ("verify" if so.scheduled_spec_decode_tokens else
                    "decode" if so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) else "prefill")
            self.steps[kind].append((time.perf_counter() - t0, sum(len(t) for t in out.sampled_token_ids)))
            return out
        runner.execute_model = timed

    def take(self) -> dict:
        summary = {kind: {"num_steps": len(rows), "median_ms": round(1000 * statistics.median(t for t, _ in rows), 2),
                          "tokens_per_step": round(sum(n for _, n in rows) / len(rows), 2)}
                   for kind, rows in self.steps.items() if rows}
        summary["drafter_total_ms"] = round(1000 * self.drafter_s, 1)
        self.steps.clear()
        self.drafter_s = 0.0
        return summary


def run(llm: LLM, profile: StepProfile, prompts: list[list[int]], params: SamplingParams) -> dict:
    engine = llm.llm_engine
    engine.scheduler.reset_prefix_cache()
    spec0 = engine.get_stats()
    profile.take()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    spec1 = engine.get_stats()
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
             for o in outs if len(o.outputs[0].token_ids) > 1]
    drafts = spec1.spec_decode_num_drafts - spec0.spec_decode_num_drafts
    drafted = spec1.spec_decode_num_draft_tokens - spec0.spec_decode_num_draft_tokens
    accepted = spec1.spec_decode_num_accepted_tokens - spec0.spec_decode_num_accepted_tokens
    per_pos0 = spec0.spec_decode_num_accepted_tokens_per_pos
    per_pos = [(n - (per_pos0[i] if i < len(per_pos0) else 0)) / drafts if drafts else 0.0
               for i, n in enumerate(spec1.spec_decode_num_accepted_tokens_per_pos)]
    return {"wall_s": round(wall, 3), "output_tokens": num_out, "output_tok_s": round(num_out / wall, 2),
            "mean_tpot_ms": round(1000 * statistics.mean(tpots), 2) if tpots else None,
            "num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "acceptance_per_position": [round(p, 4) for p in per_pos], "steps": profile.take(),
            "_tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=300, help="lines of the code-edit workload's file")
    ap.add_argument("--doc-tokens", type=int, default=1500, help="tokens of the RAG workload's document")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--workloads", nargs="+", default=["code", "rag", "peers"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--draft-layers", type=int, default=20, help="draft_model: the target's first N layers")
    ap.add_argument("--always-draft", action="store_true",
                    help="draft k tokens every step (the step-cost rule off): raw acceptance")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(max_model_len=4096, max_num_seqs=max(args.batches), kv_cache_memory="384MiB")
    draft_proposers = draft_model_proposers(llm, args.methods, list(range(args.draft_layers)))
    profile = StepProfile(llm)
    llm.generate([{"prompt_token_ids": list(range(100, 160))}] * 2, SamplingParams(max_tokens=8), use_tqdm=False)
    rows = []
    for batch in args.batches:
        loads = workloads(llm, batch, args)
        for name in args.workloads:
            prompts, params = loads[name]
            results = {}
            for m in args.methods:
                drafter = new_drafter(m, draft_proposers)
                llm.llm_engine.drafter = timed_drafter(always_draft(drafter) if args.always_draft else drafter, profile)  # fresh: no earlier run's outputs
                results[m] = run(llm, profile, prompts, params)
            base = results.get("off")
            for m, r in results.items():
                tokens = r.pop("_tokens")
                row = {"workload": name, "batch": batch, "method": m,
                       "prompt_tokens_mean": round(float(np.mean([len(p) for p in prompts])), 1), **r}
                if base is not None and m != "off":
                    row["greedy_identical"] = tokens == base_tokens
                    row["speedup_output_tok_s"] = round(r["output_tok_s"] / base["output_tok_s"], 3)
                    row["speedup_tpot"] = round(base["mean_tpot_ms"] / r["mean_tpot_ms"], 3) if r["mean_tpot_ms"] else None
                else:
                    base_tokens = tokens
                rows.append(row)
                print(f"{name:6s} batch {batch:2d} {m:7s} {r['output_tok_s']:8.1f} tok/s  TPOT {r['mean_tpot_ms']} ms  "
                      f"accept {r['acceptance_rate']}  x{row.get('speedup_output_tok_s', 1.0)}  "
                      f"identical {row.get('greedy_identical', '-')}", flush=True)
    path = common.write_result("speculative", {"settings": vars(args), "methods": METHODS, "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
