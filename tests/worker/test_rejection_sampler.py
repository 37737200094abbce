"""Rejection sampling keeps the target's distribution: chi-square over many seeded draws, for
a point-mass draft (the n-gram / suffix form) through the engine's sampler and for a general
draft distribution; and the point-mass acceptance rule by hand."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.rejection_sampler import accept_point_mass_drafts, rejection_sample
from pagedllm.worker.sampler import Sampler
from pagedllm.worker.sampling_metadata import SamplingMetadata

V = 6
NUM_DRAWS = 6000


def test_point_mass_acceptance_cuts_at_the_first_mismatch():
    assert accept_point_mass_drafts([4, 5, 6], [4, 5]) == [4, 5, 6]
    assert accept_point_mass_drafts([4, 9, 6], [4, 5]) == [4, 9]
    assert accept_point_mass_drafts([1, 9, 6], [4, 5]) == [1]
    with pytest.raises(ValueError, match="len\\(draft_token_ids\\) \\+ 1"):
        accept_point_mass_drafts([1], [4, 5])


def _target_logits() -> torch.Tensor:
    return torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0, -1.0], [0.3, 1.2, 0.0, -0.4, 0.8, -2.0]])


def _params() -> SamplingParams:
    # temperature, top-k, top-p, a logit bias and a penalty: the target's processed distribution
    return SamplingParams(temperature=0.8, top_k=5, top_p=0.95, logit_bias={2: 0.5}, presence_penalty=0.3,
                          max_tokens=4)


def _processed_probs(logits: torch.Tensor, outputs: list[list[int]]) -> torch.Tensor:
    """The distribution the sampler draws from at each row (its truncation replayed in float64)."""
    p = _params()
    x = logits.double().clone()
    for r, out in enumerate(outputs):
        x[r, 2] += 0.5
        for t in set(out):
            x[r, t] -= p.presence_penalty
    x /= p.temperature
    probs = torch.softmax(x, dim=-1)
    for r in range(x.shape[0]):
        order = probs[r].argsort(descending=True)
        keep = order[:p.top_k]
        cum = probs[r][keep].cumsum(0)
        keep = keep[:int((cum < p.top_p).sum()) + 1]
        mask = torch.zeros(V, dtype=torch.bool)
        mask[keep] = True
        probs[r] = torch.where(mask, probs[r], 0.0)
        probs[r] /= probs[r].sum()
    return probs


def test_point_mass_drafts_keep_the_target_distribution():
    """Draft [d] at position 0; the emitted first token must follow the target's row 0, and the
    second token (emitted only after an accept) the target's row 1."""
    draft = 0
    outputs = [[], [draft]]
    torch.manual_seed(0)
    md = SamplingMetadata.build(params=[_params()] * (2 * NUM_DRAWS), prompt_token_ids=[[1]] * (2 * NUM_DRAWS),
                                output_token_ids=outputs * NUM_DRAWS, generators=[None] * (2 * NUM_DRAWS),
                                eos_token_ids=[None] * (2 * NUM_DRAWS), vocab_size=V, device=torch.device("cpu"))
    sampled = Sampler()(_target_logits().repeat(NUM_DRAWS, 1), md).sampled_token_ids.view(NUM_DRAWS, 2).tolist()
    first, second = torch.zeros(V), torch.zeros(V)
    for row in sampled:  # one verify step each: rows 0 and 1 of a request drafting [draft]
        emitted = accept_point_mass_drafts(row, [draft])
        first[emitted[0]] += 1
        if len(emitted) == 2:
            second[emitted[1]] += 1
    probs = _processed_probs(_target_logits(), outputs)
    for counts, p in ((first, probs[0]), (second, probs[1])):
        support = p > 0
        assert counts[~support].sum() == 0
        _, pvalue = chisquare(counts[support].numpy(), (p[support] * counts.sum()).numpy())
        assert pvalue > 1e-3, (counts, p)


def test_general_rejection_sampling_keeps_the_target_distribution():
    p = torch.softmax(torch.tensor([[0.5, 1.5, -0.3, 0.0, 1.0, -1.0], [1.0, 0.0, 0.5, 0.2, -0.5, 0.3]]), -1)
    q = torch.softmax(torch.tensor([[1.5, 0.0, 0.5, 0.3, -1.0, 0.0]]), -1)
    gen = torch.Generator().manual_seed(0)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(NUM_DRAWS):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        out = rejection_sample(p, q, [d], gen)
        first[out[0]] += 1
        if len(out) == 2:
            second[out[1]] += 1
    for counts, target in ((first, p[0]), (second, p[1])):
        _, pvalue = chisquare(counts.numpy(), (target * counts.sum()).numpy())
        assert pvalue > 1e-3, (counts, target)


def test_rejection_sample_checks_shapes():
    with pytest.raises(ValueError, match="target_probs must be"):
        rejection_sample(torch.ones(1, V), torch.ones(1, V), [0])
