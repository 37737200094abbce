"""Incremental detokenization and stop strings, one ``IncrementalDetokenizer`` per sequence.

Each step decodes a window of recent ids (the prefix/read-offset scheme of vLLM's
``detokenize_incrementally``, from TGI's ``decode_token``), matches stop strings across
token boundaries and hands out the text safe to stream. Contract: docs/architecture.md,
"Detokenization".
"""

from __future__ import annotations

import functools
import json
import weakref
from typing import Any

from pagedllm.sampling_params import SamplingParams
from pagedllm.engine.stop_matcher import StopMatcher

_REPLACEMENT_CHAR = "\ufffd"
# Past this many ids the decode window restarts at a character boundary (cost, not text).
_MAX_WINDOW_TOKENS = 8


def _window_decoder(tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool):
    """``ids -> text`` as ``tokenizer.decode(ids, ..., clean_up_tokenization_spaces=False)``: for an
    unmodified transformers fast tokenizer that is exactly its Rust backend's ``decode``, called
    directly to skip the Python layers (once per sequence per step)."""
    backend = _rust_backend(tokenizer)
    if backend is not None:
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens,
                             spaces_between_special_tokens=spaces_between_special_tokens,
                             clean_up_tokenization_spaces=False)


def _rust_backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind an unmodified transformers decode path, else None."""
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the public decode
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if isinstance(tokenizer, TokenizersBackend) and isinstance(backend, Tokenizer) \
            and cls._decode is TokenizersBackend._decode and cls.decode is PreTrainedTokenizerBase.decode:
        return backend
    return None


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text, step by step, and finds stop strings.

    ``prompt_token_ids`` is counted, never used as decoding context. ``output_text``: complete
    characters so far, final once finished; ``token_ids``: the output ids delivered (a stop
    token included, ids after a stop string excluded); ``stop_reason``: the matched stop string.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self._decode = _window_decoder(tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)
        self.token_ids: list[int] = []
        self._text = _TextBuffer()
        self.stop_reason: str | None = None
        self.is_finished = False
        self._num_text_tokens = 0  # ids decoded into text (token_ids minus a stop token)
        # ids[_prefix_offset:] are decoded each step, from a character boundary; _last_clean_offset
        # is the latest boundary inside (restart context for decoders that strip a leading space)
        self._prefix_offset = 0
        self._last_clean_offset = 0
        self._window_emitted = 0
        self._num_emitted_chars = 0  # chars handed out by get_next_output_text
        self._stop: list[str] = list(params.stop or [])
        self._stop_matcher = StopMatcher(self._stop) if self._stop else None
        self._hold_back = bool(self._stop) and not params.include_stop_str_in_output

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append new ids and extend the text; returns the stop string that matched (the text cut
        there, later ids dropped, the sequence finished) or None. With ``stop_terminated`` the last
        id ended the sequence: recorded, never decoded, text flushed. Raises ValueError for
        ``stop_terminated`` without ids, RuntimeError after the sequence finished."""
        if self.is_finished:
            raise RuntimeError("IncrementalDetokenizer.update() called after the sequence finished")
        if stop_terminated and not new_token_ids:
            raise ValueError("stop_terminated=True needs the stop token as the last of new_token_ids")
        text_ids = new_token_ids[:-1] if stop_terminated else new_token_ids
        for token_id in text_ids:
            self.token_ids.append(token_id)
            self._num_text_tokens += 1
            num_chars_before = len(self._text)
            self._decode_next()
            if self._stop and len(self._text) > num_chars_before:
                stop = self._check_stop_strings(num_chars_before, self._num_text_tokens > self.params.min_tokens)
                if stop is not None:
                    return stop
        if stop_terminated:
            self.token_ids.append(new_token_ids[-1])
            self.flush()
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The safe text (``delta``: only its part not returned before); while unfinished, a suffix
        that may still become a stop string is held back. All deltas add up to the final text."""
        if finished:
            self.flush()
            safe_len = len(self._text)
        else:
            safe_len = max(len(self._text) - self._num_held_chars(), self._num_emitted_chars)
        start = self._num_emitted_chars
        self._num_emitted_chars = safe_len
        if not delta:
            return self.output_text[:safe_len]
        return self._text.tail(len(self._text) - start)[:safe_len - start]

    @property
    def output_text(self) -> str:
        return str(self._text)

    def flush(self) -> None:
        """Decode bytes held as an incomplete character (U+FFFD where invalid), without a stop
        check; idempotent, and afterwards ``output_text`` is final and :meth:`update` raises."""
        if self.is_finished:
            return
        window_text = self._decode(self.token_ids[self._prefix_offset:self._num_text_tokens])
        self._text.append(window_text[self._window_emitted:])
        self._window_emitted = len(window_text)
        self.is_finished = True

    def decode_token(self, token_id: int) -> str:
        """Text of one token for ``Logprob.decoded_token`` (:func:`token_text`)."""
        return token_text(self.tokenizer, token_id)

    def _decode_next(self) -> None:
        end = self._num_text_tokens
        window_text = self._decode(self.token_ids[self._prefix_offset:end])
        stable_len = len(window_text.rstrip(_REPLACEMENT_CHAR))
        if stable_len > self._window_emitted:
            self._text.append(window_text[self._window_emitted:stable_len])
            self._window_emitted = stable_len
        if stable_len < len(window_text):
            return  # ends inside a character: not a boundary, the window keeps growing
        if end - self._prefix_offset > _MAX_WINDOW_TOKENS and self._last_clean_offset > self._prefix_offset:
            # restart at the previous boundary with >= 1 id of context that has text
            context_text = self._decode(self.token_ids[self._last_clean_offset:end])
            if context_text:
                self._prefix_offset = self._last_clean_offset
                self._window_emitted = len(context_text)
        self._last_clean_offset = end

    def _check_stop_strings(self, num_chars_before: int, report: bool) -> str | None:
        """Find the earliest stop string (the longest of those ending there) ending in text appended
        after ``num_chars_before``; with ``report`` False the matcher only reads the text."""
        found = self._stop_matcher.feed(self._text.tail(len(self._text) - num_chars_before), report)
        if found is None:
            return None
        end, stop = found
        end += num_chars_before
        self._text.truncate(end if self.params.include_stop_str_in_output else end - len(stop))
        self.stop_reason = stop
        self.is_finished = True
        return stop

    def _num_held_chars(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        return self._stop_matcher.num_held() if self._hold_back else 0


class _TextBuffer:
    """Append-only text with O(k) access to (and truncation within) its last k characters:
    ``str +=`` on an attribute copies the whole string each step, so appends go to a short
    ``_recent`` string, sealed into a chunk list once it reaches ``_SEAL_CHARS``."""

    _SEAL_CHARS = 256

    def __init__(self) -> None:
        self._sealed: list[str] = []
        self._sealed_len = 0
        self._recent = ""

    def __len__(self) -> int:
        return self._sealed_len + len(self._recent)

    def __str__(self) -> str:
        if len(self._sealed) > 1:  # O(length) once; repeated reads then cost O(recent)
            self._sealed = ["".join(self._sealed)]
        return (self._sealed[0] if self._sealed else "") + self._recent

    def append(self, text: str) -> None:
        self._recent += text
        if len(self._recent) >= self._SEAL_CHARS:
            self._sealed.append(self._recent)
            self._sealed_len += len(self._recent)
            self._recent = ""

    def tail(self, num_chars: int) -> str:
        if num_chars <= len(self._recent):
            return self._recent[len(self._recent) - num_chars:] if num_chars > 0 else ""
        parts, need = [self._recent], num_chars - len(self._recent)
        for chunk in reversed(self._sealed):
            if need <= 0:
                break
            parts.append(chunk[-need:] if len(chunk) > need else chunk)
            need -= len(parts[-1])
        return "".join(reversed(parts))

    def truncate(self, length: int) -> None:
        while self._sealed and self._sealed_len > length:
            self._recent = self._sealed.pop()
            self._sealed_len -= len(self._recent)
        self._recent = self._recent[:max(0, length - self._sealed_len)]


class _TokenizerInfo:
    """Per-token bytes and display text of one tokenizer, computed once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder_types = _decoder_types(tokenizer)
        self.byte_decoder: dict[str, int] | None = None
        if "ByteLevel" in decoder_types:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self.byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        self.has_byte_fallback = "ByteFallback" in decoder_types
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added_ids = set(int(i) for i in added)
        self._text_cache: dict[int, str] = {}

    def token_bytes(self, token_id: int) -> bytes:
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if token is None:
            raise ValueError(f"token_id {token_id} is not in the vocabulary")
        if token_id in self.added_ids:
            return token.encode("utf-8")
        if self.byte_decoder is not None and all(c in self.byte_decoder for c in token):
            return bytes(self.byte_decoder[c] for c in token)
        if self.has_byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        text = self._text_cache.get(token_id)
        if text is None:
            raw = self.token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("utf-8", errors="backslashreplace")
            self._text_cache[token_id] = text
        return text


def _decoder_types(tokenizer: Any) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return {p.get("type") for p in parts}


_INFO_CACHE: "weakref.WeakKeyDictionary[Any, _TokenizerInfo]" = weakref.WeakKeyDictionary()


def _tokenizer_info(tokenizer: Any) -> _TokenizerInfo:
    try:
        info = _INFO_CACHE.get(tokenizer)
    except TypeError:  # not weak-referenceable
        return _TokenizerInfo(tokenizer)
    if info is None:
        info = _INFO_CACHE[tokenizer] = _TokenizerInfo(tokenizer)
    return info


def token_text(tokenizer: Any, token_id: int) -> str:
    """Text of one token for logprobs (``decoded_token``, the server's ``tokens`` keys): byte-level
    tokens with real spaces, special tokens as their content, invalid UTF-8 backslash-escaped
    ("\\xf0\\x9f") as the OpenAI API shows them. Cached per tokenizer."""
    return _tokenizer_info(tokenizer).token_text(token_id)


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """Raw bytes of one token (OpenAI ``logprobs[].bytes``): byte-level BPE through the GPT-2 byte
    table, byte-fallback ``<0xNN>`` its byte, added tokens their UTF-8, others ``decode([id])``'s.
    Raises ValueError outside the vocabulary."""
    return _tokenizer_info(tokenizer).token_bytes(token_id)
