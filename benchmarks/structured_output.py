"""Structured outputs: per-step cost of the grammar mask, and grammar compile times.

A batch of 32 decoding requests on SmolLM2-135M-Instruct (CPU, float32), of which 0%,
25% or 100% are constrained by a JSON schema (an array of at least 20 person objects, so
no constrained request completes inside the measured window). Every engine step is
timed whole, and inside it the three grammar phases:

- ``fill``: ``StructuredOutputManager.grammar_bitmask`` (one xgrammar bitmask row per
  constrained request that samples);
- ``apply``: ``apply_grammar_bitmask`` in the model runner (one batched call on the
  constrained rows' logits);
- ``accept``: ``accept_tokens`` (each matcher advanced by its request's new token).

Only pure decode steps with all 32 requests running are counted. The three fractions
run interleaved (``--rounds`` times each, alternating) so they see the same machine load;
the overhead is a ratio inside the same steps (grammar time / step time), and the step
times of the three fractions are compared side by side. Compile times are measured cold
(xgrammar's own cache is off; ours is bypassed) for the schemas of the test suite.

    python benchmarks/structured_output.py               # ~3 min on 2 shared cores
    python benchmarks/structured_output.py --quick       # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import common

sys.path.insert(0, str(common.REPO_ROOT))  # run from a checkout without installing
sys.path.insert(0, str(common.REPO_ROOT / "tests"))  # the test schemas (and the modules they import)
sys.path.insert(0, str(common.REPO_ROOT / "tests" / "structured_output"))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.backend_xgrammar import XgrammarBackend, grammar_spec  # noqa: E402
import pagedllm.worker.model_runner as model_runner  # noqa: E402

PEOPLE = {"type": "array", "minItems": 20, "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"]}}
QUESTIONS = ["List the people you know as JSON.", "Give me a JSON list of famous scientists.",
             "Write a JSON array of characters from a story.", "Describe the members of a football team in JSON."]


class Timers:
    """Wall time per phase inside the current step (seconds)."""

    def __init__(self) -> None:
        self.step: dict[str, float] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[name] = self.step.get(name, 0.0) + time.perf_counter() - t0
        return timed


def instrument(llm: LLM, timers: Timers) -> None:
    som = llm.llm_engine.structured_output
    som.grammar_bitmask = timers.wrap("fill", som.grammar_bitmask)
    som.accept_tokens = timers.wrap("accept", som.accept_tokens)
    model_runner.apply_grammar_bitmask = timers.wrap("apply", model_runner.apply_grammar_bitmask)


def run_batch(llm: LLM, timers: Timers, prompts: list[list[int]], fraction: float, max_tokens: int
              ) -> list[dict[str, float]]:
    """Run 32 requests (``fraction`` of them constrained) to the end; per-step timings of pure decode steps."""
    engine = llm.llm_engine
    num_constrained = round(len(prompts) * fraction)
    for i, ids in enumerate(prompts):
        so = StructuredOutputsParams(json=PEOPLE) if i < num_constrained else None
        engine.add_request(f"{fraction}-{i}", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=so))
    steps = []
    while engine.has_unfinished_requests():
        timers.step = {}
        num_running = len(engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        last = engine.scheduler.step_trace[-1] if engine.scheduler.step_trace else None
        if num_running == len(prompts) and last is not None and sum(last.values()) == len(prompts):
            steps.append({"step": elapsed, **timers.step})
    return steps


def summarize(steps: list[dict[str, float]]) -> dict[str, float]:
    med = lambda k: statistics.median(s.get(k, 0.0) for s in steps) * 1e3  # noqa: E731
    grammar = [sum(s.get(k, 0.0) for k in ("fill", "apply", "accept")) / s["step"] for s in steps]
    return {"num_steps": len(steps), "step_ms_median": med("step"), "fill_ms_median": med("fill"),
            "apply_ms_median": med("apply"), "accept_ms_median": med("accept"),
            "grammar_fraction_of_step_median": statistics.median(grammar),
            "grammar_fraction_of_step_max": max(grammar)}


def compile_times(tokenizer, vocab_size: int, stop_ids: list[int]) -> dict[str, float]:
    """Cold compile time (ms) of each test-suite schema, plus the one-off tokenizer preparation."""
    import test_server_structured as server_tests
    import test_smollm2_structured as engine_tests

    t0 = time.perf_counter()
    backend = XgrammarBackend(tokenizer, vocab_size, stop_ids)
    out = {"tokenizer_info_ms": (time.perf_counter() - t0) * 1e3}
    schemas = {f"json_schema_{i}": s for i, s in enumerate(engine_tests.SCHEMAS)}
    schemas.update(person=server_tests.PERSON, weather_tool=server_tests.WEATHER, people_array=PEOPLE)
    specs = {name: StructuredOutputsParams(json=s) for name, s in schemas.items()}
    specs["json_object"] = StructuredOutputsParams(json_object=True)
    specs["regex_phone"] = StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}")
    specs["choice_3"] = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    for name, params in specs.items():
        t0 = time.perf_counter()
        backend.compile(grammar_spec(params))
        out[name + "_ms"] = (time.perf_counter() - t0) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each fraction, interleaved")
    ap.add_argument("--quick", action="store_true", help="smoke run: batch 8, 6 tokens, 1 round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.batch, args.max_tokens, args.rounds = 8, 6, 1
    llm = LLM(max_model_len=512, max_num_seqs=max(args.batch, 8), kv_cache_memory="512MiB", seed=0)
    llm.llm_engine.scheduler.step_trace = []
    engine = llm.llm_engine
    prompts = [engine.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " " * (i // 4)}])
               for i in range(args.batch)]
    stop_ids = [engine.eos_token_id] + engine.extra_stop_token_ids
    compiles = compile_times(engine.tokenizer, engine.vocab_size, stop_ids)
    timers = Timers()
    instrument(llm, timers)
    run_batch(llm, timers, prompts[:4], 1.0, 4)  # warm-up: compiles the schema, touches every path
    fractions = [0.0, 0.25, 1.0]
    per_fraction: dict[float, list] = {f: [] for f in fractions}
    for _ in range(args.rounds):
        for f in fractions:
            per_fraction[f] += run_batch(llm, timers, prompts, f, args.max_tokens)
    results = {f"{int(f * 100)}pct_constrained": summarize(per_fraction[f]) for f in fractions}
    base = results["0pct_constrained"]["step_ms_median"]
    for r in results.values():
        r["step_time_vs_0pct"] = r["step_ms_median"] / base
    record = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, float32 CPU)", "batch": args.batch,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "schema": "people_array (minItems 20)",
              "results": results, "compile_ms": compiles}
    path = common.write_result("structured_output", record, args.out)
    full = results["100pct_constrained"]
    print(f"structured_output: batch {args.batch}, decode step {base:.1f} ms at 0% constrained; at 100%: grammar "
          f"{full['fill_ms_median'] + full['apply_ms_median'] + full['accept_ms_median']:.2f} ms/step = "
          f"{full['grammar_fraction_of_step_median']:.1%} of the step (max {full['grammar_fraction_of_step_max']:.1%}), "
          f"step time x{full['step_time_vs_0pct']:.2f} vs 0%; 25%: x{results['25pct_constrained']['step_time_vs_0pct']:.2f}; "
          f"compiles {min(v for k, v in compiles.items() if k != 'tokenizer_info_ms'):.0f}-"
          f"{max(v for k, v in compiles.items() if k != 'tokenizer_info_ms'):.0f} ms -> {path}")


if __name__ == "__main__":
    main()
