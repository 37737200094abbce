"""The batched sampler: every SamplingParams field in one pass over a step's logits ``[N, V]``.

Order: allowed ids, bad words and min_tokens masks; logit_bias; penalties; greedy argmax;
temperature; logprobs; top-k, top-p, min-p; the exponential race. Why this order, and the
sources of the formulas: docs/engine.md, "Sampling".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.outputs import SampleLogprobs
from pagedllm.worker.sampling_metadata import SamplingMetadata

# Logprob of an excluded (-inf) token: finite for JSON, below any real one (vLLM's value too).
LOGPROB_FLOOR = -9999.0

# First candidate width when top-p must be found without a top-k bound.
_TOP_P_FIRST_WIDTH = 256
# Beyond this many candidates, top-p finds its threshold by bisection instead of ranking.
_TOP_P_MAX_SORTED_WIDTH = 2048
_ARGMAX_CHUNK = 1024


@dataclass
class LogprobsTensors:
    """Logprobs of N positions, on the logits' device: ``topk_ids`` int64 [N, K] (most likely
    first) and ``topk_logprobs`` float32 [N, K]; for the chosen token (prompt logprobs: the
    actual next one) ``sampled_token_ids`` int64 [N], ``sampled_logprobs`` float32 [N] and
    ``sampled_ranks`` int64 [N] (1 + the tokens strictly more likely). Logprobs >= LOGPROB_FLOOR."""

    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    sampled_token_ids: torch.Tensor
    sampled_logprobs: torch.Tensor
    sampled_ranks: torch.Tensor

    @classmethod
    def from_logprobs(cls, logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> "LogprobsTensors":
        """Top-``k`` and ``token_ids``' entries of float32 ``logprobs`` [N, V]. Raises ValueError
        for ``k`` outside [0, V]."""
        if not 0 <= k <= logprobs.shape[-1]:
            raise ValueError(f"k must be in [0, {logprobs.shape[-1]}], got {k}")
        topk_logprobs, topk_ids = logprobs.topk(k, dim=-1)
        sampled = logprobs.gather(-1, token_ids.view(-1, 1)).squeeze(-1)
        ranks = (logprobs > sampled.unsqueeze(-1)).sum(dim=-1) + 1
        return cls(topk_ids, topk_logprobs.clamp_min(LOGPROB_FLOOR), token_ids,
                   sampled.clamp_min(LOGPROB_FLOOR), ranks)

    def to_sample_logprobs(self, num_per_row: list[int | None]) -> list[SampleLogprobs | None]:
        """Row i's host object with its first ``num_per_row[i]`` top entries (None: None); one
        host sync. Raises ValueError for a wrong length or an entry above K."""
        n, k = self.topk_ids.shape
        if len(num_per_row) != n:
            raise ValueError(f"num_per_row has {len(num_per_row)} entries for {n} rows")
        ids, lps = self.topk_ids.tolist(), self.topk_logprobs.tolist()
        tok, slp, rank = (self.sampled_token_ids.tolist(), self.sampled_logprobs.tolist(),
                          self.sampled_ranks.tolist())
        out: list[SampleLogprobs | None] = []
        for i, num in enumerate(num_per_row):
            if num is None:
                out.append(None)
                continue
            if not 0 <= num <= k:
                raise ValueError(f"num_per_row[{i}]={num} outside [0, {k}]")
            out.append(SampleLogprobs(ids[i][:num], lps[i][:num], tok[i], slp[i], rank[i]))
        return out


@dataclass
class SamplerOutput:
    """sampled_token_ids: int64 [N]; logprobs: per-row logprobs when any row asked, else None."""

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


class Sampler(torch.nn.Module):
    """Samples one token per row of float32 logits ``[N, V]``. ``forward`` modifies ``logits``
    in place (the runner passes a fresh gather) and returns a :class:`SamplerOutput`."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != metadata.num_rows:
            raise ValueError(f"logits must be [{metadata.num_rows}, V], got {tuple(logits.shape)}")
        if logits.dtype != torch.float32:
            logits = logits.float()
        if metadata.num_rows == 0:
            return SamplerOutput(torch.empty(0, dtype=torch.int64, device=logits.device), None)
        apply_token_masks(logits, metadata)
        if not metadata.no_logit_bias:
            logits.index_put_((metadata.logit_bias_rows, metadata.logit_bias_token_ids),
                              metadata.logit_bias_values, accumulate=True)
        if not metadata.no_penalties:
            apply_penalties(logits, metadata)

        greedy_ids = None if metadata.all_random else argmax_rows(logits)
        if not metadata.no_temperature:
            logits.div_(metadata.temperature.unsqueeze(1))
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = torch.log_softmax(logits, dim=-1)
        if metadata.all_greedy:
            sampled = greedy_ids
        else:
            sampled = self._sample_random(logits, metadata)
            if greedy_ids is not None:
                sampled = torch.where(metadata.is_greedy, greedy_ids, sampled)
        lpt = None
        if logprobs is not None:
            lpt = LogprobsTensors.from_logprobs(logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, lpt)

    @staticmethod
    def _sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """int64 [N], one draw per random row (greedy rows 0, overwritten by the caller)."""
        N, V = logits.shape
        sampled = torch.zeros(N, dtype=torch.int64, device=logits.device)
        for rows, bounded in ((md.top_k_rows, True), (md.top_p_only_rows, False)):
            if not rows:
                continue
            idx = _row_index(rows, logits.device)
            top_k = _rows_or_default(md.top_k, idx, V) if bounded else None
            x = logits if len(rows) == N else logits.index_select(0, idx)
            chunks = top_k_top_p_candidates(x, top_k, _rows_or_default(md.top_p, idx, 1.0))
            for local, vals, token_ids in chunks:
                chunk_idx = idx.index_select(0, local)
                if not md.no_min_p:
                    apply_min_p(vals, md.min_p.index_select(0, chunk_idx))
                gens = _local_generators(md, [rows[j] for j in local.tolist()])
                pos = exponential_race(torch.softmax(vals, dim=-1), gens, token_ids=token_ids, vocab_size=V)
                sampled.index_copy_(0, chunk_idx, token_ids.gather(1, pos.unsqueeze(1)).squeeze(1))
        rows = md.untruncated_rows
        if rows:
            full = len(rows) == N
            idx = None if full else _row_index(rows, logits.device)
            x = logits if full else logits.index_select(0, idx)
            if not md.no_min_p:
                apply_min_p(x, md.min_p if full else md.min_p.index_select(0, idx))
            drawn = exponential_race(torch.softmax(x, dim=-1), _local_generators(md, rows))
            if full:
                return drawn
            sampled.index_copy_(0, idx, drawn)
        return sampled


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of [N, V] as int64 [N], the same indices (first maximum, NaN as max).
    On CPU torch's row argmax is a scalar loop while ``amax`` is vectorized: take each chunk's
    max, then argmax only inside the first chunk holding the row max (so ties resolve as torch's).
    """
    N, V = x.shape
    if x.device.type != "cpu" or V < 2 * _ARGMAX_CHUNK or N == 0:
        return x.argmax(dim=-1)
    c = _ARGMAX_CHUNK
    num_full = V // c
    chunk_max = x[:, :num_full * c].reshape(N, num_full, c).amax(dim=-1)
    if V % c:
        chunk_max = torch.cat([chunk_max, x[:, num_full * c:].amax(dim=-1, keepdim=True)], dim=1)
    start = chunk_max.argmax(dim=-1) * c  # (N,) first column of the winning chunk
    # past the vocabulary repeat the last column: it already stands earlier, the first max holds
    cols = (start.unsqueeze(1) + torch.arange(c, device=x.device)).clamp_max_(V - 1)  # (N, c)
    return start + x.gather(1, cols).argmax(dim=-1)


def _row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _rows_or_default(t: torch.Tensor | None, idx: torch.Tensor, default: float) -> torch.Tensor:
    if t is None:
        return torch.full((idx.numel(),), default, device=idx.device,
                          dtype=torch.int64 if isinstance(default, int) else torch.float32)
    return t.index_select(0, idx)


def _local_generators(md: SamplingMetadata, rows: list[int]) -> dict[int, torch.Generator]:
    if not md.generators:
        return {}
    return {j: md.generators[r] for j, r in enumerate(rows) if r in md.generators}


def apply_token_masks(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """allowed_token_ids, bad words and min_tokens: set the masked entries of ``logits`` to -inf in place."""
    if metadata.allowed_rows is not None:
        rows = metadata.allowed_rows
        logits[rows] = logits[rows].masked_fill(metadata.disallowed_mask, float("-inf"))
    if metadata.blocked_rows is not None:
        logits[metadata.blocked_rows, metadata.blocked_token_ids] = float("-inf")


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In place on float32 ``logits`` [N, V], only the (row, token) entries listed in ``metadata``:
    repetition (CTRL) ``logit / p`` if > 0 else ``logit * p``, then frequency/presence (OpenAI)
    ``logit -= count_in_output * frequency + (count_in_output > 0) * presence``."""
    rows, toks = metadata.penalty_rows, metadata.penalty_token_ids
    vals = logits[rows, toks]
    rep = metadata.penalty_repetition
    vals = torch.where(vals > 0, vals / rep, vals * rep) - metadata.penalty_offsets
    logits[rows, toks] = vals


def top_k_top_p_candidates(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
                           ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The sorted candidates top-k then top-p keep, without sorting the vocabulary: ``logits``
    float32 [R, V], ``top_k`` int64 [R] (< V; None: widen from ``_TOP_P_FIRST_WIDTH``, one host
    sync per width), ``top_p`` float32 [R] in (0, 1]. Returns chunks ``(rows [r], vals float32
    [r, m], token_ids int64 [r, m])`` covering each row once, top m logits descending with the
    excluded at -inf (the wide chunk: m = V, token order). Top-p always keeps the top token."""
    R, V = logits.shape
    rows = torch.arange(R, device=logits.device)
    if top_k is not None:
        vals, token_ids = logits.topk(int(top_k.max()), dim=-1, sorted=True)  # (R, max_k), descending
        vals = vals.masked_fill(vals < vals.gather(1, (top_k - 1).unsqueeze(1)), float("-inf"))
        log_norm = torch.logsumexp(vals, dim=-1, keepdim=True)  # renormalized over the top-k survivors
        return [(rows, _drop_outside_nucleus(vals, log_norm, top_p), token_ids)]
    log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
    chunks, width = [], min(V, _TOP_P_FIRST_WIDTH)
    while rows.numel():
        x = logits if rows.numel() == R else logits.index_select(0, rows)
        p, norm = top_p.index_select(0, rows), log_norm.index_select(0, rows)
        if width > _TOP_P_MAX_SORTED_WIDTH:
            vals = _nucleus_by_threshold(x, norm, p)
            chunks.append((rows, vals, torch.arange(V, device=x.device).expand_as(vals)))
            break
        vals, token_ids = x.topk(width, dim=-1, sorted=True)
        if width == V:
            covered = torch.ones_like(p, dtype=torch.bool)
        else:
            covered = (vals - norm).exp().sum(dim=-1) >= p
        if bool(covered.all()):
            chunks.append((rows, _drop_outside_nucleus(vals, norm, p), token_ids))
            break
        if bool(covered.any()):
            c = covered.nonzero().squeeze(1)
            chunks.append((rows.index_select(0, c), _drop_outside_nucleus(vals.index_select(0, c), norm.index_select(0, c),
                                                                          p.index_select(0, c)), token_ids.index_select(0, c)))
        rows, width = rows[~covered], min(V, width * 8)
    return chunks


def _nucleus_by_threshold(logits: torch.Tensor, log_norm: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Logits [r, V] with tokens outside each row's nucleus at -inf, for nuclei too wide to rank:
    bisect per row for ``lo < hi`` with mass(logp >= lo) >= p > mass(logp >= hi) until at most
    ``_TOP_P_MAX_SORTED_WIDTH`` tokens lie between, then rank those. Each row stops on its own
    count, so its result does not depend on the others. ``log_norm`` [r, 1]: row logsumexp."""
    logp = logits - log_norm
    probs = logp.exp()
    finite = torch.isfinite(logp)
    hi = logp.amax(dim=-1) + 1.0  # nothing at or above: mass 0 < p
    lo = logp.masked_fill(~finite, float("inf")).amin(dim=-1)  # everything finite: mass 1 (>= p up to rounding)
    cnt_lo, cnt_hi = finite.sum(dim=-1), torch.zeros_like(hi, dtype=torch.int64)
    mass_hi = torch.zeros_like(hi)
    for step in range(64):
        active = (cnt_lo - cnt_hi) > _TOP_P_MAX_SORTED_WIDTH
        if step % 4 == 0 and not bool(active.any()):
            break
        mid = (lo + hi) / 2
        ge = logp >= mid.unsqueeze(1)
        mass, cnt = (probs * ge).sum(dim=-1), ge.sum(dim=-1)
        up = (mass >= top_p) & active
        down = ~(mass >= top_p) & active
        lo, cnt_lo = torch.where(up, mid, lo), torch.where(up, cnt, cnt_lo)
        hi, cnt_hi, mass_hi = torch.where(down, mid, hi), torch.where(down, cnt, cnt_hi), torch.where(down, mass, mass_hi)
    keep = logp >= hi.unsqueeze(1)
    between = (logp >= lo.unsqueeze(1)) & ~keep
    num_between = int((cnt_lo - cnt_hi).max())
    if num_between > 0:
        bvals, bidx = logp.masked_fill(~between, float("-inf")).topk(num_between, dim=-1, sorted=True)
        bprobs = bvals.exp()
        before = mass_hi.unsqueeze(1) + bprobs.cumsum(dim=-1) - bprobs
        keep_between = (before < top_p.unsqueeze(1)) & torch.isfinite(bvals)
        keep.scatter_(1, bidx, keep.gather(1, bidx) | keep_between)
    return logits.masked_fill(~keep, float("-inf"))


def _drop_outside_nucleus(vals: torch.Tensor, log_norm: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sorted logits [r, m] with tokens outside each row's top-p nucleus set to -inf (p = 1: none)."""
    probs = (vals - log_norm).exp()
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely candidates
    drop = (before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    return vals.masked_fill(drop, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """:func:`top_k_top_p_candidates` over [N, V], excluded at -inf; ``top_k`` <= 0 or >= V and
    ``top_p`` 1 are off. Syncs with the host."""
    N, V = logits.shape
    k = torch.full((N,), V, dtype=torch.int64, device=logits.device) if top_k is None else top_k.clone()
    k[(k <= 0) | (k > V)] = V
    p = torch.ones(N, device=logits.device) if top_p is None else top_p.float()
    out = logits.clone()
    for group in ((k < V), (k >= V) & (p < 1.0)):
        idx = group.nonzero().squeeze(1)
        if not idx.numel():
            continue
        bounded = bool((k.index_select(0, idx) < V).all())
        chunks = top_k_top_p_candidates(logits.index_select(0, idx), k.index_select(0, idx) if bounded else None,
                                        p.index_select(0, idx))
        for local, vals, ids in chunks:
            full = torch.full((local.numel(), V), float("-inf"), device=logits.device).scatter_(1, ids, vals)
            out.index_copy_(0, idx.index_select(0, local), full)
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place on float32 [R, C]: drop tokens with p < min_p × p_max, i.e.
    ``logit < max_logit + log(min_p)`` (no softmax); ``min_p`` float32 [R]."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    logits.masked_fill_(logits < threshold, float("-inf"))


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator],
                     token_ids: torch.Tensor | None = None, vocab_size: int | None = None) -> torch.Tensor:
    """One position per row, int64 [R]: ``argmax(probs / q)``, ``q = -log(U) ~ Exp(1)``, so P(i) =
    probs[i] (Gumbel-max). ``probs`` float32 [R, C] is modified in place; rows in ``generators``
    draw their own. With ``token_ids`` int64 [R, C] a seeded row draws ``vocab_size`` uniforms in
    token order and keeps its candidates', so its draw does not depend on the batch."""
    q = torch.empty_like(probs)
    num_rows = probs.shape[0]
    if not generators:
        q.uniform_()
    elif len(generators) < num_rows:
        free = torch.tensor([i for i in range(num_rows) if i not in generators], device=probs.device)
        q[free] = torch.empty(free.numel(), probs.shape[1], device=probs.device).uniform_()
    for i, gen in generators.items():
        if token_ids is None:
            q[i].uniform_(generator=gen)
        else:
            u = torch.empty(vocab_size, dtype=probs.dtype, device=probs.device).uniform_(generator=gen)
            q[i] = u[token_ids[i]]
    q.log_().neg_()
    return argmax_rows(probs.div_(q))


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Raw-distribution logprobs: row j of ``logits`` [P, V] predicts ``target_ids[j]`` (int64 [P]).
    Raises ValueError on mismatched shapes or k outside [0, V]."""
    if logits.dim() != 2 or target_ids.shape != (logits.shape[0],):
        raise ValueError(f"logits [P, V] and target_ids [P] expected, got {tuple(logits.shape)} "
                         f"and {tuple(target_ids.shape)}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return LogprobsTensors.from_logprobs(logprobs, target_ids.to(torch.int64), k)
