"""The n-gram proposer against hand-worked lookups."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.ngram import NgramProposer, find_ngram_draft


def _draft(tokens, lo, hi, k):
    return find_ngram_draft(np.asarray(tokens, dtype=np.int64), lo, hi, k)


def test_the_longest_ngram_wins_over_a_later_shorter_one():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 5, 9, 3, 8, 2, 3]  # suffix [2, 3]: at 1..2 (then 4, 5); [3] alone later at 6 (then 8)
    assert _draft(tokens, 1, 3, 3) == [4, 5, 9]
    assert _draft(tokens, 1, 1, 2) == [8, 2]  # n = 1 only: the latest occurrence of [3]


def test_the_latest_of_equally_long_matches():
    tokens = [7, 1, 2, 7, 3, 4, 7]
    assert _draft(tokens, 1, 2, 2) == [3, 4]


def test_no_match_below_the_minimum():
    assert _draft([1, 2, 3, 4, 2], 2, 4, 3) == []
    assert _draft([1, 2, 3, 4, 2], 1, 4, 3) == [3, 4, 2]
    assert _draft([5], 1, 3, 3) == []


def test_a_match_in_the_tail_repeats_periodically():
    assert _draft([4, 1, 2, 1, 2], 2, 2, 5) == [1, 2, 1, 2, 1]
    assert _draft([8, 8, 8], 1, 3, 4) == [8, 8, 8, 8]


def test_the_proposer_reads_prompt_and_output():
    req = Request("a", [10, 11, 12, 13], SamplingParams(max_tokens=8), max_tokens=8)
    req.append_output_token_ids([11, 12])
    assert NgramProposer(2, 3).propose(req, 2) == [13, 11]
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)
