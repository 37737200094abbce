"""Verification of draft tokens by rejection sampling (Leviathan et al. 2023; Chen et al. 2023):
the tokens a verify step emits are distributed exactly as the target model's own samples.

For a draft with distribution q at a position where the target's (processed) distribution is p,
draft token d is accepted with probability ``min(1, p(d) / q(d))``; on rejection the token is drawn
from ``max(0, p - q)`` renormalized and the draft ends there; when every draft is accepted one more
token is drawn from the target's distribution after the last (the bonus token).

For a draft that is a point mass (n-gram and suffix proposers: q(d) = 1) this is the same as
drawing ``x ~ p`` and accepting while ``x == d``: P(x = d) = p(d), and given ``x != d``, x follows
p without d, renormalized = ``max(0, p - q)`` normalized. :func:`accept_point_mass_drafts` uses that
form, so a verify step samples each position with the same sampler (and the same per-position
seeded generator) as a step without speculation: greedy accepts the longest prefix matching the
argmax, and seeded requests draw the same tokens with and without speculation.
"""

from __future__ import annotations

import torch


def accept_point_mass_drafts(sampled_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """The tokens a verify step emits: ``sampled_token_ids`` [k + 1] (the target's sample at each
    of the k draft positions and after the last), cut after the first that differs from
    ``draft_token_ids`` [k]. Returns 1..k + 1 tokens (the accepted drafts, then one more)."""
    if len(sampled_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(f"sampled_token_ids must hold len(draft_token_ids) + 1 = {len(draft_token_ids) + 1} "
                         f"tokens, got {len(sampled_token_ids)}")
    for j, draft in enumerate(draft_token_ids):
        if sampled_token_ids[j] != draft:
            return sampled_token_ids[:j + 1]
    return list(sampled_token_ids)


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_token_ids: list[int],
                     generator: torch.Generator | None = None) -> list[int]:
    """General rejection sampling of one request's draft: ``target_probs`` float [k + 1, V] (row j:
    the target's distribution at draft position j; row k: after the last draft), ``draft_probs``
    float [k, V] (the proposer's; each row must give its draft token a positive probability).
    Returns 1..k + 1 tokens; ValueError for mismatched shapes or a draft its own q excludes."""
    k = len(draft_token_ids)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1 or draft_probs.shape != (k, target_probs.shape[1]):
        raise ValueError(f"target_probs must be [{k + 1}, V] and draft_probs [{k}, V], got "
                         f"{tuple(target_probs.shape)} and {tuple(draft_probs.shape)}")
    dev = target_probs.device
    out: list[int] = []
    for j, d in enumerate(draft_token_ids):
        p, q = target_probs[j], draft_probs[j]
        if not q[d] > 0:
            raise ValueError(f"draft token {d} at position {j} has draft probability {float(q[d])}")
        u = torch.rand((), generator=generator, device=dev)
        if u * q[d] <= p[d]:  # accept with probability min(1, p(d) / q(d))
            out.append(d)
            continue
        residual = (p - q).clamp_min_(0)
        total = residual.sum()
        residual = residual / total if total > 0 else p  # p == q: never rejects; guard rounding
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out
