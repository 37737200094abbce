"""Incremental detokenization and stop strings (cases C18, C21, C24, C25).

The detokenizer is driven with scripted token sequences ("M_script": no model) and the
real SmolLM2 tokenizer from its GGUF (loaded as the engine loads it), plus a small
in-memory SentencePiece-style tokenizer for the decoders byte-level BPE lacks. The
reference is always the tokenizer's own ``decode`` of the delivered ids, and plain
``str.find`` on that text for stop strings.
"""

from __future__ import annotations

import copy
import itertools
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.engine.detokenizer import _MAX_WINDOW_TOKENS, IncrementalDetokenizer, _TextBuffer, token_bytes
from pagedllm.sampling_params import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FFFD = "\ufffd"
DEF, GH, I_, J_ = 33203, 23960, 57, 58  # "DEFGHIJ" = DEF|GH|I|J in SmolLM2's vocabulary
ENDOFTEXT, IM_START, IM_END = 0, 1, 2

ROUND_TRIP_STRINGS = [
    "Hello, world!", " leading space", "trailing space ", "  two leading", "double  space",
    "triple   space", "tab\there", "\ttab first", "newline\nthere", "\n\nblank line first",
    "crlf\r\nline", "café", "naïve résumé", "Ångström", "über straße", "ñandú", "Ελληνικά",
    "Русский текст", "日本語", "中文字符测试", "한국어", "😀 ok", "🙂", "emoji 🎉🎉 party",
    "👩‍👩‍👧 family", "flags 🇫🇷🇯🇵", "math ∑ ∫ √ ≤ ≥", "arrows → ← ↔", "quotes “curly” ‘single’",
    "em—dash – en", "ellipsis…", "def f(x):\n    return x ** 2\n", "if (a && b) { c(); }",
    "<html><body>hi</body></html>", "SELECT * FROM t WHERE id = 1;", "x = [1, 2, 3]",
    "path/to/file.txt", "C:\\Windows\\path", "a\u00a0nbsp", "zero\u200bwidth", "mixed 日本 and café 😀",
    "1234567890", "3.14159", "-42", "   ", "\n", "end with newline\n", "Ġ literal marker",
    "ÿþ bytes-looking", "<|not_special|> look-alike",
]


@pytest.fixture(scope="session")
def tok(smollm2_tokenizer):
    """The engine's SmolLM2 tokenizer (pagedllm.loader, built from the GGUF's metadata)."""
    return smollm2_tokenizer


def hf_decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def stream(tok, ids, params=None, chunks=None, stop_terminated=False):
    """Feed ids (one per step, or in the given chunk sizes); return (detok, deltas, stop)."""
    detok = IncrementalDetokenizer(tok, [IM_START], params or SamplingParams())
    sizes = chunks or [1] * len(ids)
    deltas, stop, pos = [], None, 0
    for n, size in enumerate(sizes):
        last = n == len(sizes) - 1
        stop = detok.update(ids[pos:pos + size], stop_terminated=stop_terminated and last)
        pos += size
        deltas.append(detok.get_next_output_text(finished=stop is not None or last, delta=True))
        if stop is not None:
            break
    return detok, deltas, stop


def compositions(n, limit=512):
    """Ways to cut n ids into consecutive non-empty chunks: all 2**(n-1) of them when that
    is at most ``limit``, else ``limit`` random ones (fixed seed)."""
    if 2 ** (n - 1) <= limit:
        all_cuts = itertools.product([False, True], repeat=n - 1)
    else:
        rng = random.Random(0)
        all_cuts = ([rng.random() < 0.5 for _ in range(n - 1)] for _ in range(limit))
    for cuts in all_cuts:
        sizes, size = [], 1
        for cut in cuts:
            if cut:
                sizes.append(size)
                size = 1
            else:
                size += 1
        yield sizes + [size]


# ---- C24: text == decode(ids); spaces; no byte-level markers ---------------------------
def test_first_delta_keeps_leading_space(tok):
    detok = IncrementalDetokenizer(tok, [IM_START], SamplingParams())
    detok.update([33662])
    assert detok.get_next_output_text(finished=False, delta=True) == " hello"
    detok.update([1116])
    assert detok.get_next_output_text(finished=False, delta=True) == "\n\n"
    assert detok.output_text == " hello\n\n"


@pytest.mark.parametrize("text", ROUND_TRIP_STRINGS)
def test_round_trip_streamed_equals_decode(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # the tokenizer itself round-trips
    detok, deltas, _ = stream(tok, ids)
    assert "".join(deltas) == detok.output_text == hf_decode(tok, ids) == text
    markers = [c for c in (FFFD, "\u0120", "\u010a") if c not in text]  # U+FFFD, "Ġ", "Ċ"
    assert not any(m in d for d in deltas for m in markers)


@pytest.mark.parametrize("text", ["😀 ok", "🙂", "日本語", "café", "👩‍👩‍👧", "é😀日"])
def test_every_split_of_multibyte_text(tok, text):
    ids = tok.encode(text)
    assert len(ids) >= 2
    for sizes in compositions(len(ids)):
        detok, deltas, _ = stream(tok, ids, chunks=sizes)
        assert "".join(deltas) == detok.output_text == text, sizes
        assert not any(FFFD in d for d in deltas), (sizes, deltas)


def test_split_character_is_held_until_complete(tok):
    assert tok.encode("🙂") == [10813, 38887]
    detok = IncrementalDetokenizer(tok, [IM_START], SamplingParams())
    detok.update([33662, 10813])  # " hello" + first two bytes of 🙂
    assert detok.output_text == " hello"
    assert detok.get_next_output_text(finished=False, delta=True) == " hello"
    detok.update([38887])
    assert detok.get_next_output_text(finished=False, delta=True) == "🙂"


def test_incomplete_bytes_at_finish_give_what_decode_gives(tok):
    # The model stopped in the middle of 🙂: the final text is decode(ids), U+FFFD included.
    detok, deltas, _ = stream(tok, [33662, 10813])
    assert deltas == [" hello", FFFD] and detok.output_text == hf_decode(tok, [33662, 10813])
    # Ended by EOS in the middle of a character: same, and the EOS is not in the text.
    detok, deltas, _ = stream(tok, [33662, 10813, IM_END], stop_terminated=True)
    assert "".join(deltas) == " hello" + FFFD and detok.token_ids == [33662, 10813, IM_END]


def test_cumulative_output_grows_and_ends_at_final_text(tok):
    ids = tok.encode("Once upon a time 😀 in 日本")
    detok = IncrementalDetokenizer(tok, [IM_START], SamplingParams())
    previous = ""
    for token_id in ids:
        detok.update([token_id])
        text = detok.get_next_output_text(finished=False, delta=False)
        assert text.startswith(previous) and FFFD not in text
        previous = text
    assert detok.get_next_output_text(finished=True, delta=False) == hf_decode(tok, ids)


def test_decode_window_stays_short(tok):
    # O(new tokens) per step: every decode call sees at most a window of recent ids.
    calls = []

    class Spy:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok.encode("The quick brown fox jumps over the lazy dog, 日本語 😀. " * 40)
    detok, deltas, _ = stream(Spy(), ids)
    assert "".join(deltas) == hf_decode(tok, ids)
    assert len(ids) > 400 and max(calls) <= _MAX_WINDOW_TOKENS + 6
    assert len(calls) <= 1.25 * len(ids) + 1


_BUFFER_OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.text(alphabet="ab日😀", max_size=3)),
    st.tuples(st.just("tail"), st.integers(-1, 300)),
    st.tuples(st.just("truncate"), st.integers(0, 300)),
    st.tuples(st.just("str"), st.none())), max_size=400)


@settings(max_examples=60, deadline=None)
@given(ops=_BUFFER_OPS)
def test_text_buffer_matches_str(ops):
    buffer, reference = _TextBuffer(), ""
    for op, arg in ops:
        if op == "append":
            buffer.append(arg)
            reference += arg
        elif op == "tail":
            assert buffer.tail(arg) == (reference[len(reference) - min(arg, len(reference)):] if arg > 0 else "")
        elif op == "truncate":
            buffer.truncate(arg)
            reference = reference[:arg]
        else:
            assert str(buffer) == reference
        assert len(buffer) == len(reference)
    assert str(buffer) == reference


def test_text_buffer_stays_short():
    buffer = _TextBuffer()
    for i in range(20_000):
        buffer.append("x" if i % 2 else "yz")
    assert len(buffer) == 30_000 and buffer.tail(3) == "yzx"
    assert len(buffer._recent) < _TextBuffer._SEAL_CHARS
    assert len(buffer._sealed) <= 30_000 // _TextBuffer._SEAL_CHARS


# ---- C25: special tokens and the stop token ------------------------------------------
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tok, skip):
    t1 = tok.encode("Hello") + [IM_END]
    t2 = tok.encode("Hi") + [ENDOFTEXT] + tok.encode(" there") + [IM_END]
    params = SamplingParams(skip_special_tokens=skip)
    for ids in (t1, t2):
        detok, deltas, _ = stream(tok, ids, params, stop_terminated=True)
        assert "".join(deltas) == detok.output_text == hf_decode(tok, ids[:-1], skip)
        assert "<|im_end|>" not in detok.output_text and detok.token_ids == ids
    detok, _, _ = stream(tok, t1, params, stop_terminated=True)
    assert detok.output_text == "Hello"
    detok, _, _ = stream(tok, t2, params, stop_terminated=True)
    assert detok.output_text == ("Hi there" if skip else "Hi<|endoftext|> there")


def test_special_tokens_mid_stream_not_stop_terminated(tok):
    # ignore_eos: the EOS is an ordinary output token; it shows only with skip=False.
    ids = tok.encode("a") + [IM_END, IM_START] + tok.encode(" b")
    for skip in (True, False):
        detok, deltas, _ = stream(tok, ids, SamplingParams(skip_special_tokens=skip))
        assert "".join(deltas) == hf_decode(tok, ids, skip)
    assert hf_decode(tok, ids, False) == "a<|im_end|><|im_start|> b"


def test_non_special_stop_token_is_not_in_text(tok):
    dot = tok.encode(".")
    assert len(dot) == 1
    ids = tok.encode("Yes") + dot
    detok, deltas, stop = stream(tok, ids, SamplingParams(stop_token_ids=dot), stop_terminated=True)
    assert stop is None and "".join(deltas) == detok.output_text == "Yes"


def test_update_after_finish_and_bad_stop_terminated(tok):
    detok = IncrementalDetokenizer(tok, [IM_START], SamplingParams())
    with pytest.raises(ValueError, match="stop_terminated"):
        detok.update([], stop_terminated=True)
    detok.update([33662, IM_END], stop_terminated=True)
    with pytest.raises(RuntimeError, match="finished"):
        detok.update([33662])


# ---- C21: stop strings across token boundaries ---------------------------------------
@pytest.fixture(scope="session")
def alphabet_script(tok):
    """Output ids of a scripted completion of "Here is the English alphabet: ABC"."""
    ids = [DEF, GH, I_, J_] + tok.encode("KLMNOPQRSTUVWXYZ\n\nThat is all.")
    assert hf_decode(tok, [DEF, GH, I_, J_]) == "DEFGHIJ"
    return ids


@pytest.mark.parametrize("stop", ["DEFGHIJ", ["DEFGHIJ"], ["EFG"], ["\n\n"], ["QRS"], ["all."], ["absent"]])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_matches_spanning_tokens(tok, alphabet_script, stop, include):
    full = hf_decode(tok, alphabet_script)
    s = stop if isinstance(stop, str) else stop[0]
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    detok, deltas, matched = stream(tok, alphabet_script, params)
    i = full.find(s)
    expected = full if i < 0 else full[:i + len(s)] if include else full[:i]
    assert detok.output_text == expected
    assert "".join(deltas) == expected  # nothing streamed was later removed
    assert matched == (None if i < 0 else s) and detok.stop_reason == matched


def test_stop_string_stops_at_the_completing_token(tok, alphabet_script):
    # "DEFGHIJ" completes with J (4th id); "EFG" starts inside DEF and completes with GH.
    for stop, num_ids in (("DEFGHIJ", 4), ("EFG", 2)):
        detok, deltas, matched = stream(tok, alphabet_script, SamplingParams(stop=stop))
        assert matched == stop and len(deltas) == num_ids and len(detok.token_ids) == num_ids
    detok, deltas, _ = stream(tok, alphabet_script, SamplingParams(stop="EFG"))
    assert deltas == ["D", ""]  # "EF" was held after DEF, then dropped


def test_streaming_holds_back_possible_stop_prefix_and_releases_it(tok):
    detok = IncrementalDetokenizer(tok, [IM_START], SamplingParams(stop=["DEFX", "HIJK"]))
    steps = []
    for token_id in (DEF, GH, I_, J_):
        assert detok.update([token_id]) is None
        steps.append(detok.get_next_output_text(finished=False, delta=True))
    # DEF could start "DEFX" (held); GH rules it out but "H" could start "HIJK"; I, J extend it.
    assert steps == ["", "DEFG", "", ""]
    assert detok.get_next_output_text(finished=True, delta=True) == "HIJ"


def test_include_stop_str_streams_without_holding(tok):
    detok = IncrementalDetokenizer(tok, [IM_START], SamplingParams(stop=["DEFX"], include_stop_str_in_output=True))
    detok.update([DEF])
    assert detok.get_next_output_text(finished=False, delta=True) == "DEF"


def test_stop_string_inside_one_token_cuts_mid_token(tok):
    detok, deltas, matched = stream(tok, [DEF, GH], SamplingParams(stop="E"))
    assert matched == "E" and detok.output_text == "D" and "".join(deltas) == "D"


def test_earliest_completed_stop_string_wins(tok):
    # "G" completes before "FGH" does; at equal ends the longer string wins.
    detok, _, matched = stream(tok, [DEF, GH], SamplingParams(stop=["FGH", "G"]))
    assert matched == "G" and detok.output_text == "DEF"
    detok, _, matched = stream(tok, [DEF, GH], SamplingParams(stop=["GH", "FGH"]))
    assert matched == "FGH" and detok.output_text == "DE"


def test_stop_strings_on_multibyte_text(tok):
    ids = tok.encode("I like 😀 and 日本語 a lot")
    for stop in ("😀", "日本", "本語 a"):
        full = hf_decode(tok, ids)
        detok, deltas, matched = stream(tok, ids, SamplingParams(stop=stop))
        assert matched == stop and detok.output_text == full[:full.find(stop)] == "".join(deltas)


# ---- C18: min_tokens vs stop strings ---------------------------------------------------
def test_min_tokens_defers_stop_strings(tok):
    dot = tok.encode(".")[0]
    ids = tok.encode("A") + [dot] + tok.encode(" B") + [dot] + tok.encode(" C") + [dot]
    # ids: A . ␣B . ␣C .  -> "." completes in tokens 2, 4 and 6.
    for min_tokens, expected_text, num_ids in ((0, "A", 2), (1, "A", 2), (2, "A. B", 4), (4, "A. B. C", 6)):
        params = SamplingParams(stop=".", min_tokens=min_tokens)
        detok, deltas, matched = stream(tok, ids, params)
        assert matched == "." and detok.output_text == expected_text == "".join(deltas)
        assert len(detok.token_ids) == num_ids
        # Same result whatever the step sizes (e.g. several ids per step).
        whole, _, _ = stream(tok, ids, params, chunks=[len(ids)])
        assert whole.output_text == expected_text
    detok, deltas, matched = stream(tok, ids, SamplingParams(stop=".", min_tokens=6))
    assert matched is None and detok.output_text == "A. B. C."


def test_min_tokens_match_may_start_before_the_floor(tok):
    # "DEFGHIJ" starts in token 1 and completes in token 4: with min_tokens=3 it matches.
    params = SamplingParams(stop="DEFGHIJ", min_tokens=3)
    detok, _, matched = stream(tok, [DEF, GH, I_, J_, DEF], params)
    assert matched == "DEFGHIJ" and detok.output_text == ""
    detok, _, matched = stream(tok, [DEF, GH, I_, J_, DEF], SamplingParams(stop="DEFGHIJ", min_tokens=4))
    assert matched is None and detok.output_text == "DEFGHIJDEF"


def test_stop_strings_with_min_tokens_never_leak_in_stream(tok):
    # "aa"-style overlap: the stop starts in text emitted before min_tokens was reached.
    a = tok.encode("a")[0]
    detok, deltas, matched = stream(tok, [a, a, a], SamplingParams(stop="aa", min_tokens=1))
    assert matched == "aa" and detok.output_text == "" and deltas == ["", ""]


# ---- property: random texts, stops and step sizes against the str.find reference ------
_ALPHABET = st.sampled_from(list("ab .,\n") + ["é", "日本", "😀", " the", "DEF", "GH", "ok"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(_ALPHABET, min_size=1, max_size=20), stops=st.lists(st.lists(_ALPHABET, min_size=1,
       max_size=3).map("".join), max_size=3), include=st.booleans(), data=st.data())
def test_random_texts_match_reference(tok, pieces, stops, include, data):
    ids = tok.encode("".join(pieces))
    full = hf_decode(tok, ids)
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)))
    params = SamplingParams(stop=stops or None, include_stop_str_in_output=include)
    detok, deltas, matched = stream(tok, ids, params, chunks=_fit(sizes, len(ids)))
    hits = sorted((full.find(s) + len(s), -len(s), s) for s in stops if s in full)
    if hits:
        end, neg_len, s = hits[0]
        assert matched == s and detok.output_text == (full[:end] if include else full[:end + neg_len])
    else:
        assert matched is None and detok.output_text == full
    assert "".join(deltas) == detok.output_text
    assert not any(FFFD in d for d in deltas)


def _fit(sizes, n):
    out, total = [], 0
    for size in sizes:
        if total >= n:
            break
        out.append(min(size, n - total))
        total += out[-1]
    return out


# ---- logprobs' decoded_token -----------------------------------------------------------
def test_decode_token_is_byte_level_aware(tok):
    detok = IncrementalDetokenizer(tok, [IM_START], SamplingParams())
    assert detok.decode_token(33662) == " hello"  # not "Ġhello"
    assert detok.decode_token(1116) == "\n\n"  # not "ĊĊ"
    assert detok.decode_token(IM_END) == "<|im_end|>"
    assert detok.decode_token(10813) == "\\xf0\\x9f"  # half an emoji: escaped bytes
    assert token_bytes(tok, 10813) + token_bytes(tok, 38887) == "🙂".encode()
    for text in ("naïve café", "日本語", " hello world\n\n"):
        ids = tok.encode(text)
        assert b"".join(token_bytes(tok, i) for i in ids) == text.encode()
    with pytest.raises(ValueError, match="token_id"):
        token_bytes(tok, 10**6)


# ---- a SentencePiece-style tokenizer: "▁" spaces, byte fallback, leading-space strip ---
@pytest.fixture(scope="session")
def sp_tok():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ("▁hello", "▁world", "▁", "x"):
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])  # Llama-2's decoder
    backend.add_special_tokens(["</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_sentencepiece_style_tokenizer(sp_tok):
    hello, world, space, x, eos = 256, 257, 258, 259, 260
    ni = [0xE6, 0x97, 0xA5]  # "日" as three byte-fallback tokens (decode: "���" until complete)
    ids = ([hello, world] + ni + [x, eos, world, space] + ni + [space, x]) * 6 + [eos, hello]
    for skip in (True, False):
        for sizes in ([1] * len(ids), [2, 3] * 40):
            detok, deltas, _ = stream(sp_tok, ids, SamplingParams(skip_special_tokens=skip),
                                      chunks=_fit(sizes, len(ids)))
            assert "".join(deltas) == detok.output_text == hf_decode(sp_tok, ids, skip)
            assert not any(FFFD in d for d in deltas)
    assert hf_decode(sp_tok, ids).startswith("hello world日x world 日 x hello world日x")
    assert token_bytes(sp_tok, 0xE6) == b"\xe6"


def test_sentencepiece_leading_space_after_skipped_special(sp_tok):
    # Whatever the window position, "▁hello" after a skipped "</s>" keeps its space (the
    # decoder strips a leading space only at the very start of the text).
    hello, eos = 256, 260
    for n in range(1, 2 * _MAX_WINDOW_TOKENS + 2):
        ids = [hello] * n + [eos, hello]
        detok, deltas, _ = stream(sp_tok, ids)
        assert "".join(deltas) == detok.output_text == hf_decode(sp_tok, ids) == "hello" + " hello" * n


# ---- the decode call: the Rust backend where transformers' decode is exactly it ------------------
@pytest.mark.parametrize("skip", [True, False])
def test_window_decoder_is_the_tokenizers_decode(tok, skip):
    """The engine's tokenizer takes the backend path, which gives tokenizer.decode's text on every
    window of every round-trip string (special tokens in between too)."""
    from pagedllm.engine.detokenizer import _rust_backend, _window_decoder

    assert _rust_backend(tok) is not None
    decode = _window_decoder(tok, skip, True)
    for text in ROUND_TRIP_STRINGS:
        ids = tok.encode(text) + [IM_END] + tok.encode(text[::-1])
        for i, j in itertools.combinations(range(len(ids) + 1), 2):
            if j - i <= 2 * _MAX_WINDOW_TOKENS:
                assert decode(ids[i:j]) == hf_decode(tok, ids[i:j], skip), (text, i, j)


def test_window_decoder_keeps_an_overridden_decode(tok):
    """A tokenizer class with its own decode (e.g. a chat wrapper post-processing text) is called, not
    bypassed."""
    from pagedllm.engine.detokenizer import _rust_backend, _window_decoder

    class Shouting(type(tok)):
        def decode(self, ids, **kwargs):
            return super().decode(ids, **kwargs).upper()

    shouting = copy.copy(tok)
    shouting.__class__ = Shouting
    assert _rust_backend(shouting) is None
    assert _window_decoder(shouting, True, True)(tok.encode("Hello there")) == "HELLO THERE"
    detok, deltas, _ = stream(shouting, tok.encode("Hello there"))
    assert detok.output_text == "HELLO THERE"
