"""StopMatcher against a brute-force reference on random texts fed in random pieces, and the cost
of one long stop string (it must not build its prefixes)."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from pagedllm.engine.stop_matcher import StopMatcher


def _reference_first_match(text: str, stops: list[str]) -> tuple[int, str] | None:
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def _reference_held(text: str, stops: list[str]) -> int:
    return max((k for k in range(1, len(text) + 1) for s in stops if len(s) > k and s.startswith(text[-k:])),
               default=0)


@pytest.mark.parametrize("seed", range(200))
def test_matches_and_held_text_equal_the_brute_force(seed):
    rng = random.Random(seed)
    alphabet = "abc" if seed % 2 else "ab€"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    matcher, fed, found = StopMatcher(stops), 0, None
    while fed < len(text) and found is None:
        piece = text[fed:fed + rng.randint(1, 5)]
        found = matcher.feed(piece)
        if found is not None:
            found = (fed + found[0], found[1])
        fed += len(piece)
        if found is None:
            assert matcher.num_held() == _reference_held(text[:fed], stops), (stops, text[:fed])
    assert found == _reference_first_match(text, stops), (stops, text)


def test_text_read_without_reporting_moves_the_state():
    m = StopMatcher(["abcd"])
    assert m.feed("xab", report=False) is None and m.num_held() == 2
    assert m.feed("cd") == (2, "abcd")


def test_a_100k_character_stop_string_costs_little_and_matches():
    rng = random.Random(0)
    stop = "".join(rng.choice("abcdefghij") for _ in range(100_000))
    tracemalloc.start()
    try:
        matcher = StopMatcher([stop, "never"])
        assert matcher.feed("zz" + stop[:-1]) is None
        held = matcher.num_held()
        found = matcher.feed(stop[-1] + "tail")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert held == len(stop) - 1
    assert found == (1, stop)
    assert peak < 100 * 2**20, f"{peak / 2**20:.0f} MiB"
