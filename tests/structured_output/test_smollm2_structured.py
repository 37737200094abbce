"""Structured outputs on the real SmolLM2-135M-Instruct: outputs validate, and greedy
constrained output does not depend on the batch or on preemption."""

from __future__ import annotations

import json
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams as SO  # noqa: E402

pytestmark = pytest.mark.slow

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS = [
    # nested objects, integer range, required fields
    {"type": "object", "properties": {
        "name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]}},
     "required": ["name", "age", "address"]},
    # arrays with bounds, enums
    {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                   "minItems": 1, "maxItems": 3},
        "mood": {"enum": ["happy", "sad", "neutral"]}},
     "required": ["colors", "mood"]},
    # numbers, booleans, optional fields
    {"type": "object", "properties": {
        "title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "rating": {"type": "number", "minimum": 0, "maximum": 10}, "seen": {"type": "boolean"},
        "note": NAME},
     "required": ["title", "year", "seen"]},
    # array of objects
    {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"]}}},
     "required": ["items"]},
    # const and anyOf
    {"type": "object", "properties": {
        "kind": {"const": "event"}, "when": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 23}, NAME]}},
     "required": ["kind", "when"]},
]
QUESTIONS = [
    "Describe a person who lives in Paris as JSON.",
    "Give me your favourite colours and your mood, as JSON.",
    "Tell me about a film you like, in JSON.",
    "Write a small shopping order as JSON.",
    "Describe an event and its hour as JSON.",
]
TOPICS = ["", " Keep it short.", " Be creative.", " Use English words."]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(model=str(smollm2_path), max_model_len=512, kv_cache_memory="256MiB")


def _chat(llm: LLM, text: str) -> dict:
    ids = llm.llm_engine.apply_chat_template([{"role": "user", "content": text}])
    return {"prompt_token_ids": ids}


def _params(so: SO | None, max_tokens: int = 120) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)


def test_twenty_json_schema_outputs_parse_and_validate(llm):
    cases = [(schema, q + t) for t in TOPICS for schema, q in zip(SCHEMAS, QUESTIONS)]
    assert len(cases) == 20
    prompts = [_chat(llm, q) for _, q in cases]
    params = [_params(SO(json=schema, disable_any_whitespace=i % 2 == 0)) for i, (schema, _) in enumerate(cases)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (schema, q), out in zip(cases, outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (q, text)
        jsonschema.validate(json.loads(text), schema)


def test_regex_and_choice_outputs_match(llm):
    prompts = [_chat(llm, "What is the phone number of the office?"), _chat(llm, "Is water wet? Answer yes or no."),
               _chat(llm, "When does the shop open?")]
    params = [_params(SO(regex=r"\(\d{3}\) \d{3}-\d{4}")), _params(SO(choice=["yes", "no"])),
              _params(SO(regex=r"([01][0-9]|2[0-3]):[0-5][0-9]"))]
    outs = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", outs[0]), outs[0]
    assert outs[1] in ("yes", "no")
    assert re.fullmatch(r"([01][0-9]|2[0-3]):[0-5][0-9]", outs[2]), outs[2]


def test_greedy_constrained_output_same_alone_in_a_batch_and_across_preemption(llm, smollm2_path):
    constrained = [(_chat(llm, QUESTIONS[i]), _params(SO(json=SCHEMAS[i]), 60)) for i in (1, 4)]
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in constrained]
    free = [(_chat(llm, f"Write a short poem about the number {i}."), SamplingParams(temperature=0.0, max_tokens=24))
            for i in range(2)]
    batch = [free[0], constrained[0], free[1], constrained[1]]
    prompts, params = [p for p, _ in batch], [sp for _, sp in batch]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [outs[1].outputs[0].token_ids, outs[3].outputs[0].token_ids] == alone
    # 10 blocks of 16 tokens cannot hold four ~80-token sequences: requests are preempted and recomputed.
    small = LLM(model=str(smollm2_path), max_model_len=160, num_kv_blocks=10, enable_prefix_caching=False)
    # compiled first (in the compile process), so that all four requests run, and contend, together
    small.generate([p for p, _ in constrained], [_params(SO(json=SCHEMAS[i]), 1) for i in (1, 4)], use_tqdm=False)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.get_stats().num_preemptions_total > 0
    assert [outs[1].outputs[0].token_ids, outs[3].outputs[0].token_ids] == alone
