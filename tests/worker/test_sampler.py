"""Sampler tests: every SamplingParams field against hand-computed references.

References are plain formulas (argmax, log_softmax, a full-sort top-k/top-p written out
here, the CTRL/OpenAI penalty formulas) and chi-square goodness of fit for sampling
frequencies (critical values from a standard chi-square table, alpha = 0.001).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import (
    LOGPROB_FLOOR,
    LogprobsTensors,
    Sampler,
    apply_top_k_top_p,
    argmax_rows,
    compute_prompt_logprobs,
)
from pagedllm.worker.sampling_metadata import SamplingMetadata

EOS = 2
# Upper 0.1% points of the chi-square distribution, df = 1..10 (any standard table).
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458,
                 7: 24.322, 8: 26.124, 9: 27.877, 10: 29.588}


def build(params, V, prompts=None, outputs=None, generators=None, eos=EOS):
    n = len(params)
    return SamplingMetadata.build(
        params=params,
        prompt_token_ids=prompts if prompts is not None else [[5, 6]] * n,
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        generators=generators if generators is not None else [None] * n,
        eos_token_ids=[eos] * n, vocab_size=V, device="cpu")


def sample(logits, params, **kw):
    md = build(params, logits.shape[1], **kw)
    return Sampler()(logits.clone(), md)


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def logits():
    torch.manual_seed(0)
    return torch.randn(8, 1000) * 3


# ----------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("V", [5, 2047, 2048, 3000, 49152, 49153])
def test_argmax_rows_equals_torch_argmax_ties_nan_and_ragged_chunks(V):
    torch.manual_seed(V)
    x = torch.randn(9, V)
    x[1] = 1.0  # all tied: the first column
    x[2, V // 3] = x[2, V - 1] = 50.0  # tie across chunks (the ragged last chunk when V % chunk)
    x[3, V - 1] = 60.0  # maximum in the last column
    x[4] = float("-inf")
    x[4, V // 2] = 0.0
    x[5] = float("-inf")  # nothing finite
    x[6, V // 2] = float("nan")  # NaN counts as the maximum in torch.argmax
    x[7, 0] = 70.0
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()
    assert argmax_rows(x[:0]).shape == (0,)


def test_temperature_zero_is_argmax_even_with_top_p_top_k(logits):
    params = [SamplingParams(temperature=0.0, top_p=0.9, top_k=50)] * 8
    out = sample(logits, params)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_all_greedy_batch_takes_the_argmax_without_any_softmax(logits, monkeypatch):
    """The all-greedy fast path: no softmax, log-softmax, sort or division over the vocabulary
    unless a row asks for logprobs (which then get their full log-softmax)."""
    calls = []

    def forbid(name, fn):
        def wrapped(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)
        return wrapped

    for name in ("softmax", "log_softmax", "sort"):
        monkeypatch.setattr(torch, name, forbid(name, getattr(torch, name)))
        monkeypatch.setattr(torch.Tensor, name, forbid(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.Tensor, "div_", forbid("div_", torch.Tensor.div_))
    out = sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert calls == [] and torch.equal(out.sampled_token_ids, logits.argmax(-1)) and out.logprobs is None
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=2)] + [SamplingParams(temperature=0.0)] * 7)
    assert calls == ["log_softmax"] and torch.equal(out.sampled_token_ids, logits.argmax(-1))
    monkeypatch.undo()
    torch.testing.assert_close(out.logprobs.topk_logprobs[0], torch.log_softmax(logits[0], -1).topk(2).values)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=2.0, top_k=1),
    dict(temperature=1.0, top_p=1e-9),
    dict(temperature=1.5, min_p=1.0),
    dict(temperature=1e-6),
    dict(temperature=1e-3, top_p=0.5, min_p=0.99),
])
def test_degenerate_random_settings_equal_greedy(logits, kwargs):
    torch.manual_seed(1)
    for _ in range(5):
        out = sample(logits, [SamplingParams(**kwargs)] * 8)
        assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_logit_bias_plus_100_forces_token(logits):
    params = [SamplingParams(temperature=1.0, logit_bias={17: 100.0}),
              SamplingParams(temperature=0.0, logit_bias={900: 100.0})] * 4
    out = sample(logits, params)
    assert out.sampled_token_ids.tolist() == [17, 900] * 4


# ----------------------------------------------------------------------- seeds / batch
def _run_steps(rows, target_index, num_steps, V=512):
    """Sample num_steps steps of a batch; rows = list of (params, seed or None). Returns target's tokens."""
    gens = [gen(s) if s is not None else None for _, s in rows]
    tokens = []
    for step in range(num_steps):
        g = torch.Generator().manual_seed(1000 + step)  # same logits for every run
        logits = torch.randn(1, V, generator=g).expand(len(rows), V).contiguous() * 2
        logits += torch.arange(len(rows)).unsqueeze(1) * 0.0  # rows share the logits
        md = build([p for p, _ in rows], V, generators=gens)
        torch.manual_seed(step * 7 + len(rows))  # unseeded rows draw from a batch-dependent stream
        tokens.append(Sampler()(logits, md).sampled_token_ids[target_index].item())
    return tokens


def test_seeded_request_independent_of_batch_and_order():
    target = (SamplingParams(temperature=0.9, top_p=0.95, top_k=100, seed=42), 42)
    others = []
    for i in range(15):
        if i % 3 == 0:
            others.append((SamplingParams(temperature=1.0, seed=i), i))
        elif i % 3 == 1:
            others.append((SamplingParams(temperature=0.7, min_p=0.05), None))
        else:
            others.append((SamplingParams(temperature=0.0, repetition_penalty=1.2), None))
    alone = _run_steps([target], 0, 6)
    in_batch = _run_steps(others[:7] + [target] + others[7:], 7, 6)
    permuted_rows = [target] + others[::-1]
    permuted = _run_steps(permuted_rows, 0, 6)
    assert alone == in_batch == permuted
    assert len(set(alone)) > 1  # it really sampled
    other_seed = _run_steps([(target[0], 43)], 0, 6)
    assert other_seed != alone


# ------------------------------------------------------------------------- statistics
SMALL_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def _expected(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Reference truncated renormalized distribution, float64, written from the definitions."""
    x = logits.double() / temperature
    p = torch.softmax(x, -1)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    kk = top_k if 0 < top_k < len(p) else len(p)
    keep[order[:kk]] = True
    q = torch.where(keep, p, 0.0)
    q = q / q.sum()
    mass, keep2 = 0.0, torch.zeros_like(keep)
    for t in order.tolist():
        if not keep[t] or mass >= top_p:
            continue
        keep2[t] = True
        mass += q[t].item()
    q = torch.where(keep2, q, 0.0)
    q = torch.where(q >= min_p * q.max(), q, 0.0)
    return q / q.sum()


def _chi_square(counts, expected_probs, total):
    support = expected_probs > 0
    exp_counts = expected_probs[support] * total
    stat = (((counts[support].double() - exp_counts) ** 2) / exp_counts).sum().item()
    return stat, int(support.sum()) - 1


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.3, min_p=0.2),
    dict(temperature=1.2, top_k=5, top_p=0.7),
    dict(temperature=1.0, top_p=0.9, min_p=0.3),
])
def test_sampling_frequencies_match_truncated_distribution(kwargs):
    n = 20_000
    torch.manual_seed(1234)
    out = sample(SMALL_LOGITS.expand(n, 8).contiguous(), [SamplingParams(**kwargs)] * n)
    counts = torch.bincount(out.sampled_token_ids, minlength=8)
    expected = _expected(SMALL_LOGITS, **kwargs)
    assert counts[expected == 0].sum().item() == 0  # truncated tokens are never drawn
    stat, df = _chi_square(counts, expected, n)
    assert df >= 1
    assert stat < CHI2_CRIT_001[df], (stat, df, counts.tolist(), expected.tolist())


@pytest.mark.parametrize("kwargs", [dict(temperature=1.0), dict(temperature=0.8, top_k=4), dict(temperature=1.0, top_p=0.7),
                                    dict(temperature=1.0, top_k=6, top_p=0.9, min_p=0.1)])
def test_seeded_rows_frequencies_match(kwargs):
    """Seeded rows draw from their own generators (full-vocabulary and candidate paths); pooled draws fit."""
    n = 4000
    out = sample(SMALL_LOGITS.expand(n, 8).contiguous(), [SamplingParams(seed=i, **kwargs) for i in range(n)],
                 generators=[gen(i) for i in range(n)])
    counts = torch.bincount(out.sampled_token_ids, minlength=8)
    expected = _expected(SMALL_LOGITS, **kwargs)
    assert counts[expected == 0].sum().item() == 0
    stat, df = _chi_square(counts, expected, n)
    assert stat < CHI2_CRIT_001[df], (stat, df, counts.tolist())


def _reference_top_k_top_p(logits, ks, ps):
    """Full-sort reference: per row, keep >= k-th largest, then nucleus over renormalized survivors."""
    out = torch.full_like(logits, float("-inf"))
    for i in range(logits.shape[0]):
        row = logits[i].double()
        V = row.numel()
        k = ks[i] if 0 < ks[i] < V else V
        kth = torch.sort(row, descending=True).values[k - 1]
        keep = row >= kth
        probs = torch.softmax(torch.where(keep, row, float("-inf")), -1)
        order = torch.argsort(probs, descending=True, stable=True)
        before = 0.0
        for t in order.tolist():
            if not keep[t]:
                break
            if before >= ps[i]:
                keep[t] = False
            before += probs[t].item()
        out[i] = torch.where(keep, logits[i], float("-inf"))
    return out


def test_top_k_top_p_matches_full_sort_reference_including_wide_nucleus():
    torch.manual_seed(5)
    V = 3000
    # Row 0 has a flat distribution: its 0.95-nucleus spans far more than the first
    # candidate width (256), so the candidate set must grow.
    logits = torch.randn(6, V) * torch.tensor([0.1, 3.0, 3.0, 1.0, 2.0, 4.0]).unsqueeze(1)
    ks = [V, 40, V, 700, V, 1]
    ps = [0.95, 0.9, 1.0, 0.5, 0.3, 1.0]
    got = apply_top_k_top_p(logits.clone(), torch.tensor(ks), torch.tensor(ps))
    ref = _reference_top_k_top_p(logits, ks, ps)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(ref)])
    assert (~torch.isinf(got[0])).sum() > 256
    assert torch.equal(got[2], logits[2])  # no truncation requested: untouched


@pytest.mark.parametrize("top_k", [0, -1, 1000, 1010])
def test_top_k_off_values_equal_no_top_k(logits, top_k):
    base = sample(logits, [SamplingParams(temperature=1.0, seed=3)] * 8, generators=[gen(3 + i) for i in range(8)])
    out = sample(logits, [SamplingParams(temperature=1.0, seed=3, top_k=top_k)] * 8,
                 generators=[gen(3 + i) for i in range(8)])
    assert torch.equal(out.sampled_token_ids, base.sampled_token_ids)
    assert build([SamplingParams(top_k=top_k)], 1000).no_top_k


def test_top_p_one_and_min_p_zero_are_off(logits):
    md = build([SamplingParams(top_p=1.0, min_p=0.0)], 1000)
    assert md.no_top_p and md.no_min_p and md.no_top_k and md.no_penalties and md.no_logit_bias
    assert md.all_random and not md.all_greedy


# -------------------------------------------------------------------------- penalties
def test_penalties_exact_values_c19():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0, 3.0, -2.0, 1.5]])
    p = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0,
                       logprobs=8)
    out = sample(logits, [p], prompts=[[1, 1, 3]], outputs=[[3, 5, 5]])
    # repetition on {1, 3, 5} once each (÷2 positive, ×2 negative), then frequency/presence on output.
    expected = torch.tensor([2.0, 1.0 / 2, -1.0, 0.5 / 2 - (1 * 0.5 + 0.25), 0.0, 3.0 / 2 - (2 * 0.5 + 0.25), -2.0, 1.5])
    lp = out.logprobs.to_sample_logprobs([8])[0]
    got = torch.full((8,), float("nan"))
    got[torch.tensor(lp.token_ids)] = torch.tensor(lp.logprobs)
    torch.testing.assert_close(got, torch.log_softmax(expected, -1), rtol=0, atol=1e-6)
    assert out.sampled_token_ids.item() == 0


def test_repetition_penalty_negative_logit_multiplied_and_prompt_counts():
    logits = torch.tensor([[-1.0, 0.2, 0.1, 0.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=3.0, logprobs=4)
    out = sample(logits, [p], prompts=[[0, 0, 0, 1]], outputs=[[]])
    expected = torch.tensor([-3.0, 0.2 / 3, 0.1, 0.0])
    lp = out.logprobs.to_sample_logprobs([4])[0]
    assert lp.token_ids[0] == 2 and out.sampled_token_ids.item() == 2
    got = torch.empty(4)
    got[torch.tensor(lp.token_ids)] = torch.tensor(lp.logprobs)
    torch.testing.assert_close(got, torch.log_softmax(expected, -1), rtol=0, atol=1e-6)


def test_presence_frequency_ignore_prompt_tokens():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    p = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    # token 0 only in the prompt: unpenalized, still argmax
    assert sample(logits, [p], prompts=[[0, 0, 0]], outputs=[[]]).sampled_token_ids.item() == 0
    assert sample(logits, [p], prompts=[[1]], outputs=[[0]]).sampled_token_ids.item() == 1


def test_penalties_of_one_row_do_not_touch_others(logits):
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(temperature=0.0, repetition_penalty=2.0,
                                                                     frequency_penalty=2.0, presence_penalty=2.0)] * 4
    top = logits.argmax(-1).tolist()
    outputs = [[t] * 3 for t in top]
    out = sample(logits, params, prompts=[[t] for t in top], outputs=outputs)
    assert out.sampled_token_ids[:4].tolist() == top[:4]
    assert all(a != b for a, b in zip(out.sampled_token_ids[4:].tolist(), top[4:]))


# ----------------------------------------------------------------- masks: C14/C18 etc.
def test_mixed_greedy_random_batch_with_masked_eos_has_no_nan():
    """C14: R0 greedy+top_p/top_k, R1 T=1e-6, R2 T=1e-3 top_p=.5, R3 T=.8 seeded, R4 greedy min_tokens (EOS -inf)."""
    torch.manual_seed(2)
    V = 300
    logits = torch.randn(1, V).expand(5, V).contiguous() * 4
    logits[:, EOS] = 50.0  # the model wants to stop
    params = [SamplingParams(temperature=0, top_p=0.9, top_k=50), SamplingParams(temperature=1e-6),
              SamplingParams(temperature=1e-3, top_p=0.5), SamplingParams(temperature=0.8, seed=1, logprobs=2),
              SamplingParams(temperature=0, min_tokens=3)]
    gens = [None, None, None, gen(1), None]
    out = sample(logits, params, generators=gens)
    ids = out.sampled_token_ids.tolist()
    assert ids[:3] == [EOS, EOS, EOS]
    assert ids[4] == logits[4].clone().index_fill_(0, torch.tensor([EOS]), -1e9).argmax().item()
    assert 0 <= ids[3] < V
    again = sample(logits, params, generators=[None, None, None, gen(1), None])
    assert again.sampled_token_ids[3].item() == ids[3]
    lp = out.logprobs
    assert torch.isfinite(lp.topk_logprobs).all() and torch.isfinite(lp.sampled_logprobs).all()
    assert lp.topk_logprobs[4].min().item() >= LOGPROB_FLOOR


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    V = 50
    logits = torch.zeros(3, V)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 8] = 8.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7])
    out = sample(logits, [p] * 3, outputs=[[], [1, 1], [1, 1, 1]])
    assert out.sampled_token_ids.tolist() == [8, 8, EOS]
    # random rows never draw a masked token
    torch.manual_seed(0)
    n = 2000
    q = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[7])
    lg = torch.zeros(n, V)
    lg[:, EOS] = 3.0
    lg[:, 7] = 3.0
    ids = sample(lg, [q] * n).sampled_token_ids
    assert not ((ids == EOS) | (ids == 7)).any()


def test_ignore_eos_leaves_eos_unmasked_for_min_tokens():
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 5.0
    p = SamplingParams(temperature=0.0, min_tokens=5, ignore_eos=True)
    assert sample(logits, [p]).sampled_token_ids.item() == EOS


def test_allowed_token_ids(logits):
    allowed = [3, 99, 500]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed),
              SamplingParams(temperature=1.5, allowed_token_ids=allowed), SamplingParams(temperature=0.0)]
    for _ in range(20):
        out = sample(logits[:3], params)
        assert out.sampled_token_ids[0].item() == allowed[int(logits[0, allowed].argmax())]
        assert out.sampled_token_ids[1].item() in allowed
        assert out.sampled_token_ids[2].item() == logits[2].argmax().item()


def test_bad_words_single_and_multi_token(logits):
    top2 = logits[0].topk(2).indices.tolist()
    p = SamplingParams(temperature=0.0)
    p.bad_words_token_ids = [[top2[0]]]
    assert sample(logits[:1], [p]).sampled_token_ids.item() == top2[1]
    q = SamplingParams(temperature=0.0)
    q.bad_words_token_ids = [[11, 12, top2[0]]]
    outs = [[5, 11, 12], [11, 13], [12], [11, 12, 9]]
    out = sample(logits[:1].expand(4, -1).contiguous(), [q] * 4, outputs=outs)
    assert out.sampled_token_ids.tolist() == [top2[1], top2[0], top2[0], top2[0]]


def test_all_masked_row_still_returns_a_valid_id():
    logits = torch.zeros(2, 10)
    p = SamplingParams(temperature=1.0, allowed_token_ids=[EOS], min_tokens=2)
    ids = sample(logits, [p, SamplingParams(temperature=0.0, allowed_token_ids=[EOS], min_tokens=2)]).sampled_token_ids
    assert ((ids >= 0) & (ids < 10)).all()


def test_out_of_vocab_ids_raise_naming_field():
    with pytest.raises(ValueError, match="logit_bias"):
        build([SamplingParams(logit_bias={10: 1.0})], 10)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        build([SamplingParams(allowed_token_ids=[10])], 10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        build([SamplingParams(min_tokens=1, stop_token_ids=[12])], 10)
    with pytest.raises(ValueError, match="generators"):
        SamplingMetadata.build([SamplingParams()], [[1]], [[]], [], [EOS], 10, "cpu")


# --------------------------------------------------------------------------- logprobs
def test_logprobs_sorted_normalized_and_sampled_rank_outside_top_k():
    torch.manual_seed(4)
    n, V = 64, 200
    logits = torch.randn(n, V) * 0.5  # flat: most draws fall outside the top 1
    params = [SamplingParams(temperature=0.8, logprobs=1 + i % 5) for i in range(n)]
    out = sample(logits, params)
    lp = out.logprobs
    assert lp.topk_ids.shape == (n, 5)
    ref = torch.log_softmax(logits / 0.8, -1)  # convention: after temperature, before truncation
    assert (lp.topk_logprobs[:, :-1] >= lp.topk_logprobs[:, 1:]).all()
    assert (lp.topk_logprobs.exp().sum(-1) <= 1 + 1e-5).all()
    sampled = out.sampled_token_ids
    torch.testing.assert_close(lp.sampled_logprobs, ref.gather(1, sampled[:, None]).squeeze(1))
    torch.testing.assert_close(lp.topk_logprobs, ref.topk(5).values)
    ranks = (ref > ref.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(lp.sampled_ranks, ranks)
    assert (lp.sampled_ranks > 5).sum() > n // 2
    rows = lp.to_sample_logprobs([p.logprobs for p in params])
    for i, r in enumerate(rows):
        assert len(r.token_ids) == params[i].logprobs == len(r.logprobs)
        assert r.sampled_token_id == sampled[i].item() and r.sampled_rank == ranks[i].item()
        if r.sampled_token_id in r.token_ids:
            assert r.logprobs[r.token_ids.index(r.sampled_token_id)] == r.sampled_logprob


def test_logprobs_greedy_top1_is_sampled_and_rows_without_logprobs_get_none(logits):
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=0)]
    out = sample(logits[:3], params)
    rows = out.logprobs.to_sample_logprobs([p.logprobs for p in params])
    assert rows[1] is None
    assert rows[0].token_ids[0] == rows[0].sampled_token_id == logits[0].argmax().item()
    assert rows[0].sampled_rank == 1
    assert rows[2].token_ids == [] and rows[2].sampled_rank == 1
    torch.testing.assert_close(torch.tensor(rows[0].logprobs), torch.log_softmax(logits[0], -1).topk(3).values)
    with pytest.raises(ValueError):
        out.logprobs.to_sample_logprobs([4, None, None])


def test_masked_tokens_report_finite_floor():
    logits = torch.zeros(1, 6)
    p = SamplingParams(temperature=0.0, allowed_token_ids=[1, 4], logprobs=4)
    row = sample(logits, [p]).logprobs.to_sample_logprobs([4])[0]
    assert row.logprobs[:2] == pytest.approx([math.log(0.5)] * 2)
    assert row.logprobs[2:] == [LOGPROB_FLOOR, LOGPROB_FLOOR]
    assert all(math.isfinite(x) for x in row.logprobs)


def test_compute_prompt_logprobs_is_raw_log_softmax():
    torch.manual_seed(9)
    logits = torch.randn(5, 40)
    targets = torch.tensor([3, 0, 39, 7, 7])
    lpt = compute_prompt_logprobs(logits, targets, 3)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lpt.sampled_logprobs, ref[torch.arange(5), targets])
    torch.testing.assert_close(lpt.topk_logprobs, ref.topk(3).values)
    assert torch.equal(lpt.topk_ids, ref.topk(3).indices)
    assert torch.equal(lpt.sampled_ranks, (ref > ref[torch.arange(5), targets][:, None]).sum(-1) + 1)
    assert isinstance(lpt, LogprobsTensors)
    entries = lpt.to_sample_logprobs([3] * 5)
    assert [e.sampled_token_id for e in entries] == targets.tolist()
    with pytest.raises(ValueError):
        compute_prompt_logprobs(logits, targets[:4], 3)


def test_seeded_top_p_row_unaffected_by_neighbour_that_widens_candidates():
    """A flat neighbour makes the top-p group rank thousands of candidates; the seeded row must not notice."""
    torch.manual_seed(11)
    V = 4000
    peaked = torch.randn(1, V) * 3
    flat = torch.randn(1, V) * 0.05
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    neighbour = SamplingParams(temperature=1.0, top_p=0.99)
    nucleus = apply_top_k_top_p(peaked.clone(), None, torch.tensor([0.9]))
    num_same_winner = 0
    for seed in range(8):
        alone = sample(peaked, [target], generators=[gen(seed)]).sampled_token_ids[0]
        both = sample(torch.cat([flat, peaked]), [neighbour, target], generators=[None, gen(seed)])
        assert both.sampled_token_ids[1] == alone
        # The candidate-space race reuses the full-vocabulary draw: when the untruncated
        # race's winner lies inside the nucleus, it also wins among the candidates.
        winner = sample(peaked, [SamplingParams(temperature=1.0, seed=5)], generators=[gen(seed)]).sampled_token_ids[0]
        if torch.isfinite(nucleus[0, winner]):
            assert winner == alone
            num_same_winner += 1
    assert num_same_winner >= 4


def test_logprobs_temperature_convention_for_greedy_rows(logits):
    """top_k=1 at T=2 is greedy but reports logprobs at T=2; T=0 reports them at T=1."""
    params = [SamplingParams(temperature=2.0, top_k=1, logprobs=2), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=1e-7, logprobs=2)]
    out = sample(logits[:3], params)
    assert torch.equal(out.sampled_token_ids, logits[:3].argmax(-1))
    torch.testing.assert_close(out.logprobs.topk_logprobs[0], torch.log_softmax(logits[0] / 2, -1).topk(2).values)
    for i in (1, 2):
        torch.testing.assert_close(out.logprobs.topk_logprobs[i], torch.log_softmax(logits[i], -1).topk(2).values)


def test_greedy_row_with_penalties_unchanged_by_random_neighbours(logits):
    """C13: a greedy request with penalties gives the same token alone and next to seeded samplers."""
    target = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0)
    top2 = logits[3].topk(2).indices.tolist()
    prompt, output = [top2[0], 3], [top2[1]]  # penalize the two favourites
    alone = sample(logits[3:4], [target], prompts=[prompt], outputs=[output]).sampled_token_ids[0].item()
    assert alone not in top2
    neighbours = [SamplingParams(temperature=1.0, seed=s, repetition_penalty=2.0, frequency_penalty=1.0, top_p=0.8)
                  for s in range(7)]
    out = sample(logits, neighbours[:3] + [target] + neighbours[3:],
                 prompts=[[1, 2]] * 3 + [prompt] + [[1, 2]] * 4, outputs=[[4]] * 3 + [output] + [[5]] * 4,
                 generators=[gen(s) for s in range(3)] + [None] + [gen(s) for s in range(3, 7)])
    assert out.sampled_token_ids[3].item() == alone


# ------------------------------------------------------------------ property-based
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_V = 64
_row_params = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 1e-6, 0.3, 1.0, 1.7]),
    "top_k": st.sampled_from([0, -1, 1, 5, _V, _V + 3]),
    "top_p": st.sampled_from([1e-9, 0.3, 0.9, 1.0]),
    "min_p": st.sampled_from([0.0, 0.1, 1.0]),
    "repetition_penalty": st.sampled_from([1.0, 1.5]),
    "presence_penalty": st.sampled_from([0.0, 1.0]),
    "min_tokens": st.sampled_from([0, 5]),
    "seed": st.one_of(st.none(), st.integers(0, 1000)),
    "allowed": st.one_of(st.none(), st.lists(st.integers(0, _V - 1), min_size=2, max_size=6, unique=True)),
    "logprobs": st.one_of(st.none(), st.integers(0, 4)),
})


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(_row_params, min_size=1, max_size=6), data_seed=st.integers(0, 2**16), perm_seed=st.integers(0, 99))
def test_random_batches_valid_and_seeded_rows_batch_independent(rows, data_seed, perm_seed):
    g = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(len(rows), _V, generator=g) * 3
    logits[:, EOS] += 4.0
    params = [SamplingParams(temperature=r["temperature"], top_k=r["top_k"], top_p=r["top_p"], min_p=r["min_p"],
                             repetition_penalty=r["repetition_penalty"], presence_penalty=r["presence_penalty"],
                             min_tokens=r["min_tokens"], seed=r["seed"], allowed_token_ids=r["allowed"],
                             stop_token_ids=[7], logprobs=r["logprobs"]) for r in rows]
    outputs = [[3, 4]] * len(rows)

    def run(order):
        gens = [gen(params[i].seed) if params[i].seed is not None else None for i in order]
        out = sample(logits[order], [params[i] for i in order], prompts=[[5]] * len(order),
                     outputs=[outputs[i] for i in order], generators=gens)
        return {i: out.sampled_token_ids[j].item() for j, i in enumerate(order)}, out

    ids, out = run(list(range(len(rows))))
    for i, p in enumerate(params):
        t = ids[i]
        assert 0 <= t < _V
        if p.allowed_token_ids is not None and not (p.min_tokens and set(p.allowed_token_ids) <= {EOS, 7}):
            assert t in p.allowed_token_ids
        if p.min_tokens > len(outputs[i]) and not (p.allowed_token_ids and set(p.allowed_token_ids) <= {EOS, 7}):
            assert t not in (EOS, 7)
    if out.logprobs is not None:
        assert torch.isfinite(out.logprobs.topk_logprobs).all() and torch.isfinite(out.logprobs.sampled_logprobs).all()
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(perm_seed)).tolist()
    permuted, _ = run(order)
    for i, p in enumerate(params):
        if p.seed is not None or p.is_greedy:
            assert permuted[i] == ids[i]
            alone, _ = run([i])
            assert alone[i] == ids[i]


def test_sampler_overhead_benchmark_quick(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "sampler_overhead.py"
    out = tmp_path / "so.json"
    res = subprocess.run([sys.executable, str(script), "--quick", "--threads", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("\n") == 1 and "sampler_overhead" in res.stdout
    rec = json.loads(out.read_text())
    assert set(rec["scenarios"]) == {"greedy", "random", "penalties", "logprobs"}
    assert all(v["total_ms"] > 0 for v in rec["scenarios"].values())


def test_empty_batch_and_bfloat16_logits():
    out = Sampler()(torch.zeros(0, 10), SamplingMetadata.build([], [], [], [], [], 10, "cpu"))
    assert out.sampled_token_ids.shape == (0,) and out.sampled_token_ids.dtype == torch.int64
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0]], dtype=torch.bfloat16)
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=1)])
    assert out.sampled_token_ids.tolist() == [1]
    torch.testing.assert_close(out.logprobs.sampled_logprobs, torch.log_softmax(logits.float(), -1)[:, 1])


def test_wide_nucleus_threshold_path_matches_sorted_reference():
    """Nuclei of thousands of tokens are found by bisection; they must equal the sorted definition."""
    torch.manual_seed(21)
    V = 20000
    scales = torch.tensor([0.05, 0.5, 1.0, 1.5, 0.2])
    logits = torch.randn(5, V) * scales.unsqueeze(1)
    logits[4, :5000] = float("-inf")  # masked tokens never enter the nucleus
    ps = torch.tensor([0.9, 0.95, 0.99, 0.999, 0.5])
    got = apply_top_k_top_p(logits.clone(), None, ps)
    probs = torch.softmax(logits.double(), -1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < ps.double().unsqueeze(1)
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted) & torch.isfinite(logits)
    sizes = keep.sum(-1)
    assert (sizes > 2048).sum() >= 3  # the threshold path really ran
    mismatch = (torch.isfinite(got) != keep).sum(-1)
    assert (mismatch <= 1).all(), mismatch  # float32 vs float64 mass can flip one boundary token
    assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])


def test_seeded_wide_nucleus_row_independent_of_batch():
    torch.manual_seed(22)
    V = 12000
    flat_a, flat_b = torch.randn(1, V) * 0.3, torch.randn(1, V) * 0.1
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=9)
    for seed in range(4):
        alone = sample(flat_a, [target], generators=[gen(seed)]).sampled_token_ids[0]
        batch = sample(torch.cat([flat_b, flat_a, flat_b]), [SamplingParams(top_p=0.99), target,
                                                            SamplingParams(top_p=0.6, seed=1)],
                       generators=[None, gen(seed), gen(1)])
        assert batch.sampled_token_ids[1] == alone
