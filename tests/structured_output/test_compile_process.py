"""Grammar compiles in their own process: a compile past its time or memory limit fails only its
request (the error names the limit), a compile whose request left is stopped, and the engine keeps
serving every other request meanwhile (C54)."""

from __future__ import annotations

import json
import re
import time

import pytest

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow  # compile processes start (seconds each)

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams as SO  # noqa: E402
from pagedllm.structured_output.backend_xgrammar import GrammarSpec, XgrammarBackend  # noqa: E402
from pagedllm.structured_output.compile_process import CompileLimitError  # noqa: E402

PROMPT = {"prompt_token_ids": list(range(100, 130))}


def slow_schema(bound: int = 40000) -> dict:
    """C54's schema: its conversion is quadratic in the repetition bound (minutes at this one)."""
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": f"^[a-z]{{1,{bound}}}$"}},
            "required": ["s"]}


def _greedy(so, max_tokens=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so, **kw)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), max_model_len=256, num_kv_blocks=64,
               structured_outputs_compile_timeout_s=2.0)


def test_a_compile_past_its_time_limit_fails_only_its_request(llm):
    outs = llm.generate([PROMPT] * 3, [_greedy(SO(json=slow_schema())), _greedy(None, 6, ignore_eos=True),
                                       _greedy(SO(regex=r"\d{3}"))], use_tqdm=False)
    slow, free, fast = outs
    assert slow.outputs[0].finish_reason == "error"
    assert "structured_outputs_compile_timeout_s" in slow.error and "2 s" in slow.error
    assert len(free.outputs[0].token_ids) == 6
    assert re.fullmatch(r"\d{3}", fast.outputs[0].text)
    # the killed compile process is replaced: later constraints still compile
    again = llm.generate([PROMPT], _greedy(SO(choice=["yes", "no"])), use_tqdm=False)[0].outputs[0]
    assert again.text in ("yes", "no")
    assert llm.llm_engine.get_stats().num_used_blocks == 0


def test_a_compile_whose_request_left_is_stopped(llm):
    engine = llm.llm_engine
    llm.generate([PROMPT], _greedy(SO(regex="a")), use_tqdm=False)  # the compile process runs
    process = engine.structured_output.backend().process
    cancelled, timed_out = process.num_cancelled, process.num_killed - process.num_cancelled
    engine.add_request("slow", PROMPT, _greedy(SO(json=slow_schema(40001))))  # not the cached failure above
    engine.step()
    engine.abort_request("slow")
    deadline = time.monotonic() + 60
    while process.num_killed - process.num_cancelled == timed_out and process.num_cancelled == cancelled \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (process.num_cancelled, process.num_killed - process.num_cancelled) == (cancelled + 1, timed_out)
    out = llm.generate([PROMPT], _greedy(SO(regex=r"\d{2}")), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"\d{2}", out.text)
    # the cancelled compile is not a cached result: the same schema compiles again (and times out)
    again = llm.generate([PROMPT], _greedy(SO(json=slow_schema(40001))), use_tqdm=False)[0]
    assert "structured_outputs_compile_timeout_s" in again.error


def test_a_compile_past_its_memory_limit_fails_naming_it(smollm2_tokenizer):
    starved = XgrammarBackend(smollm2_tokenizer, len(smollm2_tokenizer), [2], timeout_s=600.0, memory_mb=1)
    try:
        for _ in range(2):  # the process that failed is replaced
            with pytest.raises(CompileLimitError, match="1 MiB.*structured_outputs_compile_memory_mb"):
                starved.compile(GrammarSpec("json", json.dumps({"type": "array", "items": {"type": "string"}})))
    finally:
        starved.close()


def test_invalid_specs_found_by_the_compile_are_value_errors(llm):
    with pytest.raises(ValueError, match="undefined"):
        llm.llm_engine.structured_output.backend().compile(GrammarSpec("grammar", "root ::= undefined"))
