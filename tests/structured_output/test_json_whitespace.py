"""JSON grammars bound the whitespace between tokens (a run past the bound is refused), and
``disable_any_whitespace`` leaves none; checked on the compiled grammar the engine uses."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")

from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.backend_xgrammar import (  # noqa: E402
    MAX_JSON_WHITESPACE, XgrammarBackend, grammar_spec, validate_structured_outputs)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
          "required": ["a", "b"]}
CHARS = ['{', '}', '"', ':', ',', ' ', '\n', '\t', 'a', 'b', '1', 'x', '[', ']']


@pytest.fixture(scope="module")
def backend():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0} | {t: i + 1 for i, t in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")
    return XgrammarBackend(tokenizer, len(vocab), [0])


def _accepts(backend, params: StructuredOutputsParams, text: str) -> bool:
    matcher = backend.new_matcher(backend.compile(grammar_spec(params)))
    return matcher.accept_string(text)


@pytest.mark.parametrize("kind", ["json", "json_object"])
def test_a_whitespace_run_past_the_bound_is_refused(backend, kind):
    params = StructuredOutputsParams(json=SCHEMA) if kind == "json" else StructuredOutputsParams(json_object=True)
    ok = " " * MAX_JSON_WHITESPACE
    assert _accepts(backend, params, '{' + ok + '"a": 1,\n  "b": "x"' + ok + '}')
    assert _accepts(backend, params, '{\n' + '\t' * (MAX_JSON_WHITESPACE - 1) + '"a": 1, "b": "x"}')
    assert not _accepts(backend, params, '{"a"' + " " * (MAX_JSON_WHITESPACE + 1))
    assert not _accepts(backend, params, '{"a": 1,' + "\n" * 200)
    validate_structured_outputs(params)


def test_disable_any_whitespace_is_compact(backend):
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    assert _accepts(backend, params, json.dumps({"a": 1, "b": "x"}))  # one space after ':' and ','
    assert not _accepts(backend, params, '{"a":  1')
    assert not _accepts(backend, params, '{ "a"')
