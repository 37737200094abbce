"""The grammar backend on xgrammar (Dong et al. 2024): spec → grammar, compiles per tokenizer, matchers.

Bitmask: int32 words, bit j of word i allows token 32*i + j. Only matcher calls run on the step loop.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from pagedllm.sampling_params import StructuredOutputsParams

# Longest whitespace run allowed between JSON tokens (room for a newline and indentation), so a
# model that favours whitespace is forced on to the next token instead of looping until max_tokens.
MAX_JSON_WHITESPACE = 12


def _whitespace_kwargs(any_whitespace: bool) -> dict[str, Any]:
    return {"any_whitespace": any_whitespace, "max_whitespace_cnt": MAX_JSON_WHITESPACE if any_whitespace else None}


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint in canonical, hashable form; ``kind``: json, regex, grammar (EBNF, also choice) or json_object."""

    kind: str
    text: str
    any_whitespace: bool = True


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """Canonical spec of ``params``. Raises ValueError naming the field for JSON that does not parse."""
    ws = not params.disable_any_whitespace
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {schema!r}")
        return GrammarSpec("json", json.dumps(schema, ensure_ascii=False), ws)
    if kind == "choice":
        return GrammarSpec("grammar", choice_as_ebnf(params.choice))
    if kind == "json_object":
        return GrammarSpec("json_object", "", ws)
    return GrammarSpec(kind, getattr(params, kind))


def choice_as_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``; JSON escaping is valid xgrammar EBNF."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def validate_structured_outputs(params: StructuredOutputsParams) -> GrammarSpec:
    """The spec, once it compiles without a tokenizer. Raises ValueError naming the field; ImportError."""
    xgr = _import_xgrammar()
    spec = grammar_spec(params)
    field = f"structured_outputs.{params.kind}"
    try:
        if spec.kind == "json":
            _check_json_schema(json.loads(spec.text))
            xgr.Grammar.from_json_schema(spec.text, **_whitespace_kwargs(spec.any_whitespace))
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.text)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{field} is invalid: {_clean_error(e)}") from None
    return spec


def _check_json_schema(schema: Any) -> None:
    try:
        import jsonschema
    except ImportError:  # xgrammar's own checks still run
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(f"{e.message}" + (f" (at {path})" if path else "")) from None


def _clean_error(e: Exception) -> str:
    """xgrammar's message without its C++ source prefix (``[12:00:00] /project/cpp/x.cc:94: ``)."""
    msg = str(e).strip()
    return re.sub(r"^\[[\d:]+\] [^:]+:\d+: ", "", msg).replace("Check failed: (error.empty()) is false: ", "")


def _import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError("structured outputs need xgrammar: pip install 'pagedllm[structured]'") from e
    return xgrammar


def tokenizer_fingerprint(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> str:
    """sha256 of the vocabulary, vocab size and stop ids: the tokenizer half of the compile-cache key."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    h = hashlib.sha256()
    h.update(json.dumps([vocab_size, sorted(stop_token_ids)]).encode())
    for text, tid in vocab:
        h.update(f"{tid}\x00{text}\x01".encode())
    return h.hexdigest()


class XgrammarBackend:
    """Compiles specs for one tokenizer (``compile`` is thread-safe); ``vocab_size``: the logits width."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2) -> None:
        xgr = _import_xgrammar()
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # the manager caches compiled grammars; xgrammar's cache would hold a second copy
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, spec: GrammarSpec):
        """The ``xgrammar.CompiledGrammar`` of ``spec``. Raises RuntimeError from xgrammar on failure."""
        c = self.compiler
        if spec.kind == "json":
            # strict_mode (as in vLLM): no properties beyond those listed unless additionalProperties
            return c.compile_json_schema(spec.text, **_whitespace_kwargs(spec.any_whitespace))
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', strict_mode=False,
                                         **_whitespace_kwargs(spec.any_whitespace))
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "grammar":
            return c.compile_grammar(spec.text)
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def new_matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)
