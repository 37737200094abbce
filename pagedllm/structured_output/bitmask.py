"""Applying the step's grammar bitmask to the logits: one batched call, constrained rows only."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.structured_output.manager import GrammarBitmask


def apply_grammar_bitmask(logits: torch.Tensor, sample_req_ids: list[str], grammar: GrammarBitmask) -> None:
    """Set forbidden tokens to -inf in place; logits float [N, V], row i for ``sample_req_ids[i]``
    (a request's rows in position order on both sides: the n-th row of a request gets its n-th mask)."""
    import xgrammar

    pos = dict(zip(_row_keys(sample_req_ids), range(len(sample_req_ids))))
    keys = _row_keys(grammar.req_ids)
    src = [j for j, key in enumerate(keys) if key in pos]
    if not src:
        return
    dst = [pos[keys[j]] for j in src]
    if dst == src:  # rows line up: no copy
        bitmask = torch.from_numpy(grammar.bitmask)
    else:
        full = np.full((logits.shape[0], grammar.bitmask.shape[1]), -1, dtype=np.int32)
        full[dst] = grammar.bitmask[src]
        bitmask = torch.from_numpy(full)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=dst)


def _row_keys(req_ids: list[str]) -> list[tuple[str, int]]:
    """(request id, how many rows of that request came before)."""
    seen: dict[str, int] = {}
    keys = []
    for rid in req_ids:
        keys.append((rid, seen.get(rid, 0)))
        seen[rid] = keys[-1][1] + 1
    return keys
