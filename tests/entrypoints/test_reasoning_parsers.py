"""Reasoning parsers: the ``<think>`` split whole and streamed (split at every boundary),
with and without the opening tag, thinking switched off, a cut inside the reasoning."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS, detect_reasoning_parser, get_reasoning_parser, prompt_reasoning_state)

# (parser, starts_in_reasoning, output, reasoning, content)
CASES = [
    ("qwen3", None, "<think>\nThe user greets me.\n</think>\n\nHello!", "The user greets me.", "Hello!"),
    ("qwen3", None, "Hello! No thinking here.", None, "Hello! No thinking here."),
    ("qwen3", False, "Hello!", None, "Hello!"),
    ("qwen3", True, "Thinking in the prompt's block.\n</think>\n\nDone.", "Thinking in the prompt's block.", "Done."),
    ("qwen3", None, "<think>\n\n</think>\n\nShort answer.", "", "Short answer."),
    ("deepseek_r1", None, "Okay, 2+2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2+2 is 4.", "The answer is 4."),
    ("deepseek_r1", None, "<think>\nHmm </think\n</think>\n\nx < y", "Hmm </think", "x < y"),
    ("deepseek_r1", None, "Cut off while still reasoning about <", "Cut off while still reasoning about <", ""),
    ("deepseek_r1", False, "Plain answer </think> kept", None, "Plain answer </think> kept"),
    ("qwen3", None, "<think>\nStill thinking when max_tokens hit", "Still thinking when max_tokens hit", ""),
]
IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


def _stream(name, starts, pieces):
    parser = get_reasoning_parser(name)(starts)
    reasoning = content = ""
    for k, piece in enumerate(pieces):
        r, c = parser.stream(piece, is_final=k == len(pieces) - 1)
        reasoning += r or ""
        content += c or ""
    return reasoning, content


@pytest.mark.parametrize("name,starts,text,reasoning,content", CASES, ids=IDS)
def test_whole_output(name, starts, text, reasoning, content):
    assert get_reasoning_parser(name)(starts).extract(text) == (reasoning, content)


@pytest.mark.parametrize("name,starts,text,reasoning,content", CASES, ids=IDS)
def test_stream_at_every_boundary(name, starts, text, reasoning, content):
    assert _stream(name, starts, list(text)) == (reasoning or "", content)
    for cut in range(1, len(text)):
        assert _stream(name, starts, [text[:cut], text[cut:]]) == (reasoning or "", content), cut


def test_no_tag_piece_is_streamed_as_text():
    parser = get_reasoning_parser("qwen3")(None)
    pieces = [parser.stream(ch) for ch in "<think>a</think>b"]
    assert all("<" not in (r or "") + (c or "") for r, c in pieces)


def test_prompt_state():
    assert prompt_reasoning_state("<|im_start|>assistant\n<think>\n") is True
    assert prompt_reasoning_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") is False
    assert prompt_reasoning_state("<|im_start|>assistant\n") is None
    assert prompt_reasoning_state("<think>old</think>Earlier answer.<|im_end|>\n<|im_start|>assistant\n") is None


def test_registry_and_detection():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")
    assert detect_reasoning_parser("<|im_start|>assistant\n{% if enable_thinking is false %}<think>\n\n</think>") \
        is REASONING_PARSERS["qwen3"]
    assert detect_reasoning_parser("{{'<｜Assistant｜>'}}{% if '</think>' in content %}") \
        is REASONING_PARSERS["deepseek_r1"]
    assert detect_reasoning_parser("<|im_start|>assistant\n") is None
