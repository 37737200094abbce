"""N-gram proposer (prompt lookup decoding): the last n tokens are looked up earlier in the
prompt and output, and the tokens that followed their latest occurrence are the draft (continued periodically when that occurrence overlaps the tail)."""

from __future__ import annotations

import numpy as np

from pagedllm.core.request import Request
from pagedllm.spec_decode.proposer import Proposer


def find_ngram_draft(token_ids: np.ndarray, min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """The draft after the longest n-gram (``min_n <= n <= max_n``) ending ``token_ids`` that also
    occurs earlier, at its latest such occurrence; ``[]`` when none. ``token_ids`` int64 [L]."""
    length = len(token_ids)
    if length <= min_n or num_tokens <= 0:
        return []
    max_n = min(max_n, length - 1)
    # candidates: positions p < L - 1 whose token equals the last one; the match ends at p
    ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
    if len(ends) == 0:
        return []
    match_len = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, max_n):
        alive &= ends - j >= 0
        if not alive.any():
            break
        same = np.zeros(len(ends), dtype=bool)
        same[alive] = token_ids[ends[alive] - j] == token_ids[length - 1 - j]
        alive &= same
        match_len += alive
    best = int(match_len.max())
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(match_len == best)[-1]])  # the latest of the longest
    draft = token_ids[end + 1:end + 1 + num_tokens].tolist()
    while len(draft) < num_tokens:  # a match inside the tail (a loop): the draft repeats itself
        draft.append(draft[end + 1 + len(draft) - length])
    return draft


class NgramProposer(Proposer):
    """``prompt_lookup_min`` / ``prompt_lookup_max``: the n-gram lengths tried (longest wins)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        tokens = np.asarray(request.all_token_ids, dtype=np.int64)
        return find_ngram_draft(tokens, self.min_n, self.max_n, num_tokens)
