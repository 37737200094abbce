"""The grammar backend on xgrammar (Dong et al. 2024): spec → grammar, compiles per tokenizer, matchers.

Bitmask: int32 words, bit j of word i allows token 32*i + j. Only matcher calls run on the step loop.
Validation on the request path does only what costs time linear in the spec (JSON parsing, the
meta-schema, unsupported features, regex and EBNF parsing); a JSON schema's conversion, which can
take seconds, runs with the compile in the compile process (``compile_process.py``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.compile_process import GrammarCompileProcess
from pagedllm.structured_output.json_schema_support import supported_schema

# Longest whitespace run allowed between JSON tokens (room for a newline and indentation), so a
# model that favours whitespace is forced on to the next token instead of looping until max_tokens.
MAX_JSON_WHITESPACE = 12
# longest spec text (a schema's JSON, a regex, a grammar) a request may carry
MAX_SPEC_CHARS = 1_000_000


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
    """The spec to compile, checked in time linear in its size. Raises ValueError naming the field
    (also for a JSON-schema feature the grammar would drop); ImportError without xgrammar."""
    xgr = _import_xgrammar()
    spec = grammar_spec(params)
    field = f"structured_outputs.{params.kind}"
    if len(spec.text) > MAX_SPEC_CHARS:
        raise ValueError(f"{field} is {len(spec.text)} characters long; at most {MAX_SPEC_CHARS} are accepted")
    try:
        if spec.kind == "json":
            schema = json.loads(spec.text)
            _check_json_schema(schema)
            merged = supported_schema(schema)
            for pattern in _patterns(merged):
                xgr.Grammar.from_regex(pattern)
            if merged != schema:
                spec = GrammarSpec("json", json.dumps(merged, ensure_ascii=False), spec.any_whitespace)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.text)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{field} is invalid: {clean_error(e)}") from None
    return spec


def _patterns(schema: Any) -> list[str]:
    """Every string ``pattern`` in a schema (parsing one costs microseconds; converting the schema does not)."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            stack.extend(v for k, v in node.items() if k not in ("enum", "const", "default", "examples"))
        elif isinstance(node, list):
            stack.extend(node)
    return found


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


def clean_error(e: Exception) -> str:
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


def compile_spec(compiler, kind: str, text: str, any_whitespace: bool):
    """``compiler``'s ``xgrammar.CompiledGrammar`` of one spec. Raises RuntimeError from xgrammar on failure."""
    ws = _whitespace_kwargs(any_whitespace)
    if kind == "json":
        # strict_mode (as in vLLM): no properties beyond those listed unless additionalProperties
        return compiler.compile_json_schema(text, **ws)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **ws)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "grammar":
        return compiler.compile_grammar(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


class XgrammarBackend:
    """Compiles specs for one tokenizer in a child process (``compile`` from one thread at a time,
    ``cancel`` from any); ``vocab_size``: the logits width."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], timeout_s: float = 30.0,
                 memory_mb: int | None = 2048) -> None:
        xgr = _import_xgrammar()
        self._xgr = xgr
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=stop_token_ids)
        self.process = GrammarCompileProcess(self._info.serialize_json(), timeout_s, memory_mb)
        self.vocab_size = vocab_size

    def compile(self, spec: GrammarSpec):
        """The ``xgrammar.CompiledGrammar`` of ``spec``. Raises ValueError (invalid spec) or
        CompileLimitError (past a limit, or cancelled)."""
        serialized = self.process.compile(spec.kind, spec.text, spec.any_whitespace)
        return self._xgr.CompiledGrammar.deserialize_json(serialized, self._info)

    def cancel(self, spec: GrammarSpec) -> None:
        """Stop the compile of ``spec`` if it runs; its ``compile`` raises CompileCancelled."""
        self.process.cancel(spec.kind, spec.text, spec.any_whitespace)

    def close(self) -> None:
        self.process.close()

    def new_matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)
