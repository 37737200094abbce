"""Structured outputs through the engine, on the tiny random Llama (SmolLM2 vocabulary).

Random weights produce arbitrary text, so a constraint is visible: every output must be in
the grammar's language. Greedy constrained output must not depend on the batch or on
preemption; seeds, n > 1 and logprobs keep working; compiles are shared and run off the
step loop; bad specs are a ValueError naming the field.
"""

from __future__ import annotations

import json
import re
import threading

import pytest

pytest.importorskip("xgrammar")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.core.request import RequestStatus  # noqa: E402
from pagedllm.sampling_params import ReasoningBoundary, StructuredOutputsParams as SO  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tag": {"type": "string", "enum": ["red", "green"]},
    "ok": {"type": "boolean"}}, "required": ["id", "tag", "ok"]}
PHONE = r"\d{3}-\d{4}"
PROMPTS = [{"prompt_token_ids": list(range(100 + 7 * i, 140 + 11 * i))} for i in range(6)]


def _llm(tiny_model_dir, **kw) -> LLM:
    kw.setdefault("max_model_len", 512)
    kw.setdefault("num_kv_blocks", 256)
    return LLM(model=str(tiny_model_dir), **kw)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return _llm(tiny_model_dir)


def _greedy(so: SO | None, max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so, **kw)


def _constraints() -> list[SO]:
    return [SO(json=SCHEMA, disable_any_whitespace=True), SO(regex=PHONE), SO(choice=["alpha", "beta", "gamma"]),
            SO(grammar='root ::= "(" [0-9]{1,3} ")"')]


def _check(so: SO, text: str) -> None:
    if so.json is not None:
        obj = json.loads(text)
        assert set(obj) == {"id", "tag", "ok"} and obj["tag"] in ("red", "green") and 0 <= obj["id"] <= 999
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), text
    elif so.choice is not None:
        assert text in so.choice
    else:
        assert re.fullmatch(r"\([0-9]{1,3}\)", text), text


def test_every_kind_of_constraint_holds_and_batch_does_not_change_greedy_output(llm):
    sos = _constraints()
    alone = [llm.generate([p], _greedy(so), use_tqdm=False)[0].outputs[0] for p, so in zip(PROMPTS, sos)]
    for so, out in zip(sos, alone):
        _check(so, out.text)
        assert out.finish_reason == "stop"
    # The same requests mixed with unconstrained ones, in one batch.
    mixed_prompts = [p for pair in zip(PROMPTS, PROMPTS[::-1]) for p in pair][:8]
    mixed_params = [x for so in sos for x in (_greedy(so), _greedy(None, ignore_eos=True))]
    outs = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[0::2]] == [a.token_ids for a in alone]
    free_alone = [llm.generate([p], _greedy(None, ignore_eos=True), use_tqdm=False)[0] for p in mixed_prompts[1::2]]
    assert [o.outputs[0].token_ids for o in outs[1::2]] == [o.outputs[0].token_ids for o in free_alone]


def test_constrained_greedy_output_survives_preemption(tiny_model_dir, llm):
    sos = _constraints() * 3
    prompts = (PROMPTS * 2)[:len(sos)]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, [_greedy(so) for so in sos], use_tqdm=False)]
    small = _llm(tiny_model_dir, num_kv_blocks=12, max_model_len=128, enable_prefix_caching=False)
    outs = small.generate(prompts, [_greedy(so) for so in sos], use_tqdm=False)
    assert small.llm_engine.get_stats().num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert small.llm_engine.get_stats().num_used_blocks == 0


def test_seeded_n_samples_follow_the_grammar_and_reproduce(llm):
    params = SamplingParams(temperature=1.0, n=4, seed=5, max_tokens=20, logprobs=3, structured_outputs=SO(regex=PHONE))
    first = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    again = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for out, out2 in zip(first, again):
        texts = [c.text for c in out.outputs]
        assert len(set(texts)) > 1  # the children differ
        assert texts == [c.text for c in out2.outputs]
        for c in out.outputs:
            _check(SO(regex=PHONE), c.text)
            # logprobs are after the mask: the first position may only be a digit; a
            # masked token can only appear at the floor.
            for tid, lp in c.logprobs[0].items():
                assert lp.decoded_token.isdigit() or lp.logprob == -9999.0, (tid, lp)


def test_grammar_termination_ends_the_request_even_with_ignore_eos(llm):
    out = llm.generate(PROMPTS[:1], _greedy(SO(choice=["alpha", "beta"]), max_tokens=30, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
    assert len(out.token_ids) < 30


def test_one_compile_per_spec_shared_by_requests_and_children(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    som = llm.llm_engine.structured_output
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=8, n=2, seed=1, structured_outputs=SO(regex=PHONE)),
                 use_tqdm=False)
    llm.generate(PROMPTS[3:], _greedy(SO(regex=PHONE), 8), use_tqdm=False)
    assert som.num_compiles == 1
    llm.generate(PROMPTS[:1], _greedy(SO(regex=r"\d+"), 4), use_tqdm=False)
    assert som.num_compiles == 2
    assert som._requests == {} and not som.has_pending()  # nothing left behind


def test_slow_compile_delays_only_its_own_request(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    engine = llm.llm_engine
    backend = engine.structured_output.backend()
    release = threading.Event()
    real_compile = backend.compile

    def slow_compile(spec):
        assert release.wait(600)
        return real_compile(spec)

    backend.compile = slow_compile
    engine.add_request("slow", PROMPTS[0], _greedy(SO(regex=PHONE), 12))
    engine.add_request("free", PROMPTS[1], _greedy(None, 6, ignore_eos=True))
    finished = {}
    for _ in range(20):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if "free" in finished:
            break
    assert "free" in finished and "slow" not in finished
    assert [r.status for r in engine.scheduler.requests.values()] == [RequestStatus.WAITING_FOR_GRAMMAR]
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    _check(SO(regex=PHONE), finished["slow"].outputs[0].text)


def test_failed_compile_fails_only_that_request(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    backend = llm.llm_engine.structured_output.backend()

    def broken(spec):
        raise RuntimeError("compiler exploded")

    backend.compile = broken
    outs = llm.generate(PROMPTS[:2], [_greedy(SO(regex=PHONE)), _greedy(None, 5, ignore_eos=True)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "compiler exploded" in outs[0].error
    assert len(outs[1].outputs[0].token_ids) == 5
    assert llm.llm_engine.get_stats().num_used_blocks == 0


@pytest.mark.parametrize("so,field", [
    (lambda: SO(json={"type": "object", "properties": {"a": {"type": "bogus"}}}), "structured_outputs.json"),
    (lambda: SO(json={"type": "object", "required": "a"}), "structured_outputs.json"),
    (lambda: SO(json="{not json"), "structured_outputs.json"),
    (lambda: SO(regex="(abc"), "structured_outputs.regex"),
    (lambda: SO(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (lambda: SO(choice=[]), "structured_outputs.choice"),
    (lambda: SO(), "structured_outputs"),
    (lambda: SO(regex="a", choice=["a"]), "structured_outputs"),
])
def test_bad_specs_name_the_field_and_leave_the_engine_usable(llm, so, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(PROMPTS[:1], _greedy(so()), use_tqdm=False)
    assert llm.llm_engine.get_stats().num_waiting == 0
    out = llm.generate(PROMPTS[:1], _greedy(SO(choice=["yes", "no"])), use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no")


def test_the_grammar_starts_after_the_reasoning_end_tag(llm):
    """vLLM's enable_in_reasoning false: the output before the end tag is the unconstrained greedy
    output, token for token; after it the grammar holds. The random model's own 4th greedy token
    stands in for the end tag."""
    prompt = PROMPTS[0]
    free = llm.generate([prompt], _greedy(None, ignore_eos=True))[0].outputs[0].token_ids
    end = free[3]
    k = free.index(end) + 1
    so = SO(regex=PHONE, reasoning_boundary=ReasoningBoundary((end,)))
    out = llm.generate([prompt], _greedy(so))[0].outputs[0]
    assert list(out.token_ids[:k]) == list(free[:k]) and out.finish_reason == "stop"
    answer = llm.get_tokenizer().decode(out.token_ids[k:], skip_special_tokens=True)
    assert re.fullmatch(PHONE, answer), answer
