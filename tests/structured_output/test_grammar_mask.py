"""The grammar mask token by token, on a tiny byte-level BPE tokenizer, against a reference.

The reference for "token t may follow the output so far" is the regex itself: the
text so far + t must be a prefix of some string of the language (``regex`` partial
full-match); EOS is allowed exactly when the text so far is in the language. Every
token of the vocabulary is checked at every step of seeded random walks.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import regex
import torch

pytest.importorskip("xgrammar")

from pagedllm.core.outputs import SchedulerOutput  # noqa: E402
from pagedllm.core.request import Request, RequestStatus  # noqa: E402
from pagedllm.sampling_params import ReasoningBoundary, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.backend_xgrammar import XgrammarBackend, grammar_spec  # noqa: E402
from pagedllm.structured_output.bitmask import apply_grammar_bitmask  # noqa: E402
from pagedllm.structured_output.manager import GrammarBitmask, StructuredOutputManager  # noqa: E402

VOCAB = ["<eos>", "a", "b", "c", "ab", "ba", "abc", "x", "1", "2", "12", "-", "bc", "xa"]
MERGES = [("a", "b"), ("b", "a"), ("ab", "c"), ("1", "2"), ("b", "c"), ("x", "a")]
EOS = 0
MODEL_VOCAB = 16  # two padding ids past the tokenizer's vocabulary: never allowed


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(VOCAB)}, merges=MERGES))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


@pytest.fixture(scope="module")
def backend(tokenizer):
    return XgrammarBackend(tokenizer, MODEL_VOCAB, [EOS])


def _allowed(bitmask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return {int(t) for t in np.nonzero(bits[:MODEL_VOCAB])[0]}


def _reference(pattern: str, text: str) -> set[int]:
    ok = {t for t in range(1, len(VOCAB)) if regex.fullmatch(pattern, text + VOCAB[t], partial=True)}
    return ok | ({EOS} if regex.fullmatch(pattern, text) else set())


@pytest.mark.parametrize("kind,pattern", [
    ("regex", r"(ab|c)+x?"),
    ("regex", r"[abc]{2,4}-[12]{1,2}"),
    ("choice", None),
])
def test_mask_matches_the_language_token_by_token(backend, kind, pattern):
    choices = ["ab", "abc", "ba", "x-1", "xa2"]
    if kind == "choice":
        params = StructuredOutputsParams(choice=choices)
        pattern = "|".join(regex.escape(c) for c in choices)
    else:
        params = StructuredOutputsParams(regex=pattern)
    compiled = backend.compile(grammar_spec(params))
    rng = random.Random(0)
    num_checked = 0
    for _walk in range(8):
        matcher, text = backend.new_matcher(compiled), ""
        bitmask = np.zeros((1, 1), dtype=np.int32)
        for _step in range(10):
            matcher.fill_next_token_bitmask(bitmask, 0)
            allowed = _allowed(bitmask[0])
            assert allowed == _reference(pattern, text), (kind, pattern, text)
            num_checked += 1
            tok = rng.choice(sorted(allowed))
            assert matcher.accept_token(tok)
            if tok == EOS:
                assert matcher.is_terminated()
                break
            text += VOCAB[tok]
        disallowed = next(t for t in range(1, len(VOCAB)) if t not in _reference(pattern, text))
        if not matcher.is_terminated():
            assert not matcher.accept_token(disallowed)
    assert num_checked >= 16


def _request(rid: str, params: StructuredOutputsParams | None, output: list[int] | None = None) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(max_tokens=8, structured_outputs=params), EOS)
    req.append_output_token_ids(output or [])
    return req


class _Scheduler:
    """The part of the scheduler the manager talks to: the request map and set_grammar_ready."""

    def __init__(self, *reqs: Request) -> None:
        self.requests = {r.request_id: r for r in reqs}
        for r in reqs:
            r.status = RequestStatus.WAITING_FOR_GRAMMAR if r.use_structured_output else RequestStatus.WAITING

    def set_grammar_ready(self, rid: str) -> None:
        self.requests[rid].status = RequestStatus.WAITING


def _manager(tokenizer, *reqs: Request) -> tuple[StructuredOutputManager, _Scheduler]:
    m = StructuredOutputManager(tokenizer, MODEL_VOCAB, [EOS], max_num_seqs=4)
    sched = _Scheduler(*reqs)
    for r in reqs:
        if r.use_structured_output:
            m.add_request(r, grammar_spec(r.sampling_params.structured_outputs))
    while m.has_pending():
        assert m.update_ready(sched, block=True, timeout=5.0) == {}
    return m, sched


def test_manager_compiles_once_per_spec_and_masks_only_sampling_rows(tokenizer):
    a = StructuredOutputsParams(regex=r"(ab|c)+x?")
    r1, r2, r3 = _request("r1", a), _request("r2", a), _request("r3", StructuredOutputsParams(choice=["ba", "x"]))
    free = _request("free", None)
    m, sched = _manager(tokenizer, r1, r2, r3, free)
    assert m.num_compiles == 2  # r1 and r2 share one compile
    assert all(r.status == RequestStatus.WAITING for r in (r1, r2, r3, free))
    # r2 is mid-prefill (2 of its 3 prompt tokens this step): it does not sample, so no row.
    so = SchedulerOutput(num_scheduled_tokens={"free": 3, "r3": 3, "r2": 2, "r1": 3})
    gb = m.grammar_bitmask(so, sched.requests)
    assert gb.req_ids == ["r3", "r1"]
    assert _allowed(gb.bitmask[0]) == {2, 5, 7}  # "b" (of "ba"), "ba", "x"
    assert _allowed(gb.bitmask[1]) == _reference(r"(ab|c)+x?", "")


def test_matcher_follows_output_and_rolls_back(tokenizer):
    pattern = r"(ab|c)+x?"
    r1 = _request("r1", StructuredOutputsParams(regex=pattern))
    m, sched = _manager(tokenizer, r1)
    r1.append_output_token_ids([4, 3])  # "ab" "c"
    assert m.accept_tokens([r1]).terminated == []
    so = SchedulerOutput(num_scheduled_tokens={"r1": 1})
    r1.num_computed_tokens = r1.num_tokens - 1
    assert _allowed(m.grammar_bitmask(so, sched.requests).bitmask[0]) == _reference(pattern, "abc")
    # The engine takes a token back (recompute from a shorter output): the matcher follows.
    r1.output_token_ids.pop()
    r1.all_token_ids.pop()
    r1.num_computed_tokens = r1.num_tokens - 1
    m.accept_tokens([r1])
    assert _allowed(m.grammar_bitmask(so, sched.requests).bitmask[0]) == _reference(pattern, "ab")
    r1.append_output_token_ids([7])  # "x": nothing may follow but EOS
    r1.append_output_token_ids([EOS])
    result = m.accept_tokens([r1])
    assert result.terminated == ["r1"] and result.rejected == {}


def test_rejected_token_is_reported(tokenizer):
    r1 = _request("r1", StructuredOutputsParams(choice=["ba"]))
    m, _ = _manager(tokenizer, r1)
    r1.append_output_token_ids([1])  # "a" cannot start "ba"
    assert "violates the grammar" in m.accept_tokens([r1]).rejected["r1"]


def test_bitmask_applied_to_constrained_rows_only_in_any_order():
    torch.manual_seed(0)
    logits = torch.randn(4, MODEL_VOCAB)
    ref = logits.clone()
    bitmask = np.zeros((2, 1), dtype=np.int32)
    bitmask[0, 0] = 0b0110  # tokens 1, 2 for "c"
    bitmask[1, 0] = 0b1000_0000  # token 7 for "a"
    apply_grammar_bitmask(logits, ["a", "b", "c", "d"], GrammarBitmask(["c", "a"], bitmask))
    for row, keep in ((0, {7}), (2, {1, 2})):
        for t in range(MODEL_VOCAB):
            assert logits[row, t] == (ref[row, t] if t in keep else float("-inf"))
    assert torch.equal(logits[[1, 3]], ref[[1, 3]])  # unconstrained rows untouched


def _sampling(so: SchedulerOutput, m: StructuredOutputManager, sched: _Scheduler) -> dict[str, set[int]]:
    """The allowed-token set of each request with a bitmask row this step (prompt done: it samples)."""
    for rid in so.num_scheduled_tokens:
        sched.requests[rid].num_computed_tokens = sched.requests[rid].num_tokens - 1
    gb = m.grammar_bitmask(so, sched.requests)
    return {} if gb is None else {rid: _allowed(gb.bitmask[i]) for i, rid in enumerate(gb.req_ids)}


def test_grammar_starts_after_the_reasoning_end_tag(tokenizer):
    """Output starting inside the block ("-" its end tag): free reasoning, no matcher advance on it."""
    pattern = r"(ab|c)+"
    r1 = _request("r1", StructuredOutputsParams(regex=pattern, reasoning_boundary=ReasoningBoundary((11,))))
    m, sched = _manager(tokenizer, r1)
    so = SchedulerOutput(num_scheduled_tokens={"r1": 1})
    assert _sampling(so, m, sched) == {}
    r1.append_output_token_ids([1, 2, 9, 7])  # "a" "b" "2" "x": outside the grammar, and not rejected
    assert m.accept_tokens([r1]).rejected == {} and _sampling(so, m, sched) == {}
    r1.append_output_token_ids([11])  # the end tag
    assert m.accept_tokens([r1]).rejected == {}
    assert _sampling(so, m, sched) == {"r1": _reference(pattern, "")}
    r1.append_output_token_ids([4])
    m.accept_tokens([r1])
    assert _sampling(so, m, sched) == {"r1": _reference(pattern, "ab")}
    # rolled back into the reasoning: free again, and the grammar restarts at the next end tag
    for _ in range(2):
        r1.output_token_ids.pop()
        r1.all_token_ids.pop()
    m.accept_tokens([r1])
    assert _sampling(so, m, sched) == {}
    r1.append_output_token_ids([11, 3, EOS])
    result = m.accept_tokens([r1])
    assert result.rejected == {} and result.terminated == ["r1"]


def test_an_output_may_open_the_block_or_be_all_answer(tokenizer):
    """Opening tag "x" "a" (two tokens): allowed first beside the grammar, then finished; without it the
    grammar holds from the first token."""
    pattern = r"(ab|c)+"
    boundary = ReasoningBoundary((11,), (7, 1))
    opens = _request("opens", StructuredOutputsParams(regex=pattern, reasoning_boundary=boundary))
    answers = _request("answers", StructuredOutputsParams(regex=pattern, reasoning_boundary=boundary))
    m, sched = _manager(tokenizer, opens, answers)
    so = SchedulerOutput(num_scheduled_tokens={"opens": 1, "answers": 1})
    assert _sampling(so, m, sched) == {"opens": _reference(pattern, "") | {7}, "answers": _reference(pattern, "") | {7}}
    opens.append_output_token_ids([7])
    answers.append_output_token_ids([4])
    assert m.accept_tokens([opens, answers]).rejected == {}
    assert _sampling(so, m, sched) == {"opens": {1}, "answers": _reference(pattern, "ab")}
    opens.append_output_token_ids([1, 9, 2])  # the tag's end, then free reasoning
    answers.append_output_token_ids([2])  # "b" after "ab": outside the grammar
    result = m.accept_tokens([opens, answers])
    assert result.rejected.keys() == {"answers"} and _sampling(
        SchedulerOutput(num_scheduled_tokens={"opens": 1}), m, sched) == {}
    opens.append_output_token_ids([11, 3])
    assert m.accept_tokens([opens]).rejected == {}
    assert _sampling(SchedulerOutput(num_scheduled_tokens={"opens": 1}), m, sched) == {"opens": _reference(pattern, "c")}


def test_reasoning_boundary_is_validated():
    with pytest.raises(ValueError, match="end_token_ids"):
        ReasoningBoundary(())
    with pytest.raises(ValueError, match="start_token_ids"):
        ReasoningBoundary((1,), (-1,))
    with pytest.raises(ValueError, match="reasoning_boundary"):
        StructuredOutputsParams(regex="a", reasoning_boundary={"end_token_ids": [1]})


def test_structured_outputs_config_is_parsed_and_errors_name_the_field():
    from pagedllm.config import EngineConfig, StructuredOutputsConfig

    assert StructuredOutputsConfig.parse(None).enable_in_reasoning is False
    assert StructuredOutputsConfig.parse('{"enable_in_reasoning": true}').enable_in_reasoning is True
    for bad, field in (('{"enable_in_reasoning": 1}', "enable_in_reasoning"), ('{"backend": "outlines"}', "backend"),
                       ('{"nope": 1}', "unknown keys"), ("[1]", "JSON object"), ("{", "JSON object")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(model="m", structured_outputs_config=bad)
