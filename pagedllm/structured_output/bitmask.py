"""Applying the step's grammar bitmask to the logits: one batched call, constrained rows only."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.structured_output.manager import GrammarBitmask


def apply_grammar_bitmask(logits: torch.Tensor, sample_req_ids: list[str], grammar: GrammarBitmask) -> None:
    """Set forbidden tokens to -inf in place; logits float [N, V], row i for ``sample_req_ids[i]``."""
    import xgrammar

    pos = {rid: i for i, rid in enumerate(sample_req_ids)}
    src = [j for j, rid in enumerate(grammar.req_ids) if rid in pos]
    if not src:
        return
    dst = [pos[grammar.req_ids[j]] for j in src]
    if dst == src:  # rows line up: no copy
        bitmask = torch.from_numpy(grammar.bitmask)
    else:
        full = np.full((logits.shape[0], grammar.bitmask.shape[1]), -1, dtype=np.int32)
        full[dst] = grammar.bitmask[src]
        bitmask = torch.from_numpy(full)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=dst)
