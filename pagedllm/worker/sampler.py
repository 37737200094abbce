"""The batched sampler: every SamplingParams field in one pass over the logits of a step.

Pipeline for logits ``[N, V]`` (one row per request sampling this step), in this order:

1. ``allowed_token_ids``: every other token -> -inf.
2. ``bad_words``: the last token of a banned sequence whose preceding tokens equal the
   tail of the output -> -inf (one-token bad words always).
3. ``min_tokens``: while fewer output tokens than ``min_tokens`` were delivered, EOS
   (unless ``ignore_eos``) and ``stop_token_ids`` -> -inf.
4. ``logit_bias``: added (after the masks, so a bias never revives a masked token).
5. Penalties: repetition (CTRL, Keskar et al. 2019, as in HF transformers and vLLM) on
   every distinct token of prompt + output, once per token: positive logits divided by
   the penalty, negative ones multiplied; then frequency and presence (OpenAI API docs,
   "Parameter details": ``logit -= count * frequency_penalty + (count > 0) *
   presence_penalty``) on output tokens only.
6. Greedy rows: argmax of these processed logits.
7. Temperature: logits are divided by the request's temperature (after the greedy
   argmax; temperatures below ``SAMPLING_EPS`` are greedy and divide by 1, so no row
   overflows to inf/NaN and no greedy row is divided by a placeholder).
8. Logprobs (when any row asks): ``log_softmax`` of the logits at this point, i.e. the
   model distribution *after penalties, masks, bias and temperature, before top-k/top-p/
   min-p truncation* (issue 4: "after temperature and penalties"; temperature-0 rows are
   at temperature 1). Masked tokens (-inf) are reported as ``LOGPROB_FLOOR`` so JSON never
   sees -inf.
9. Top-k (keep tokens whose logit is >= the k-th largest), then top-p (nucleus sampling,
   Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration": the smallest set
   of most likely tokens whose probability, renormalized after top-k, reaches p), then
   min-p (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling": drop tokens with
   probability < min_p × the top token's probability).
10. Sample by the exponential race (Gumbel-max trick): ``argmax(probs / q)`` with
    ``q ~ Exp(1)`` i.i.d. per token selects token i with probability ``probs[i]``.
    Unseeded rows share one batched draw from torch's default generator; each seeded row
    draws its own ``q`` row from its request's generator, so a seeded request's tokens do
    not depend on what else is in the batch or on the batch order.

Top-k and top-p never sort the vocabulary: rows with top-k rank only their top
``max(top_k)`` logits; rows with top-p but no top-k rank the top 256, then 2,048, for
the rows whose top tokens do not yet hold their nucleus (one host sync per try), and
find wider nuclei by bisecting for their probability threshold (with SmolLM2 at
temperature 1 and top_p 0.95 the median nucleus is ~120 tokens, the largest seen ~4,700).
Those rows are then sampled among their candidates only; rows with neither are sampled
over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.outputs import SampleLogprobs
from pagedllm.worker.sampling_metadata import SamplingMetadata

# Logprob reported for a token the processed distribution excludes (-inf): finite, so
# JSON encoders never see -inf, and far below any real logprob (float32 log_softmax of
# finite logits is > -1e4 in practice). vLLM's OpenAI server uses the same value.
LOGPROB_FLOOR = -9999.0

# First candidate width when top-p must be found without a top-k bound.
_TOP_P_FIRST_WIDTH = 256
# Beyond this many candidates, top-p finds its threshold by bisection instead of ranking.
_TOP_P_MAX_SORTED_WIDTH = 2048
# argmax_rows on CPU: columns per chunk of the two-pass search (rows narrower than two chunks
# take torch.argmax directly).
_ARGMAX_CHUNK = 1024


@dataclass
class LogprobsTensors:
    """Logprobs of N positions: the top K of each and the chosen token's own.

    Tensors (device of the logits):
        topk_ids: int64 [N, K] — token ids, most likely first.
        topk_logprobs: float32 [N, K] — their logprobs, descending, >= LOGPROB_FLOOR.
        sampled_token_ids: int64 [N] — the chosen (or, for prompt logprobs, the actual next) token.
        sampled_logprobs: float32 [N] — its logprob (>= LOGPROB_FLOOR).
        sampled_ranks: int64 [N] — 1 + the number of tokens strictly more likely than it.
    """

    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    sampled_token_ids: torch.Tensor
    sampled_logprobs: torch.Tensor
    sampled_ranks: torch.Tensor

    @classmethod
    def from_logprobs(cls, logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> "LogprobsTensors":
        """Top-``k`` and ``token_ids``' entries of ``logprobs`` (float32 [N, V]); -inf -> LOGPROB_FLOOR.

        Raises:
            ValueError: if ``k`` is negative or larger than V.
        """
        if not 0 <= k <= logprobs.shape[-1]:
            raise ValueError(f"k must be in [0, {logprobs.shape[-1]}], got {k}")
        topk_logprobs, topk_ids = logprobs.topk(k, dim=-1)
        sampled = logprobs.gather(-1, token_ids.view(-1, 1)).squeeze(-1)
        ranks = (logprobs > sampled.unsqueeze(-1)).sum(dim=-1) + 1
        return cls(topk_ids, topk_logprobs.clamp_min(LOGPROB_FLOOR), token_ids,
                   sampled.clamp_min(LOGPROB_FLOOR), ranks)

    def to_sample_logprobs(self, num_per_row: list[int | None]) -> list[SampleLogprobs | None]:
        """Per-row host objects: row i keeps its first ``num_per_row[i]`` top entries (None -> None).

        Copies the tensors to the host once (one sync).

        Raises:
            ValueError: when ``num_per_row`` has the wrong length or asks for more than K.
        """
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
    """Samples one token per row from float32 logits ``[N, V]`` (see the module docstring).

    ``forward(logits, metadata)`` modifies ``logits`` in place (the model runner hands in a
    fresh gather of the last positions' logits) and returns a :class:`SamplerOutput`.
    """

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
        """int64 [N]: one draw per random row (greedy rows' entries are 0, overwritten by the caller).

        Rows with top-k or top-p are sampled among their sorted candidates only (no
        scatter back to the vocabulary); rows without are sampled over the vocabulary.
        """
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
    """``x.argmax(dim=-1)`` of a 2-D tensor [N, V], the same indices (first maximum; NaN counts
    as the maximum, as in torch.argmax), int64 [N].

    On CPU, torch's argmax over a row is a scalar loop (several ms for 64 rows of a 49K
    vocabulary) while ``amax`` is vectorized; so for wide rows it takes each chunk's max
    with ``amax``, the first chunk holding the row's maximum with a small argmax, and the
    index inside that chunk with argmax over ``_ARGMAX_CHUNK`` columns. The first chunk whose
    max equals the row max holds the row's first maximum, so ties resolve as torch's do.
    """
    N, V = x.shape
    if x.device.type != "cpu" or V < 2 * _ARGMAX_CHUNK or N == 0:
        return x.argmax(dim=-1)
    c = _ARGMAX_CHUNK
    num_full = V // c
    chunk_max = x[:, :num_full * c].reshape(N, num_full, c).amax(dim=-1)  # (N, num_full)
    if V % c:  # the ragged last chunk
        chunk_max = torch.cat([chunk_max, x[:, num_full * c:].amax(dim=-1, keepdim=True)], dim=1)
    start = chunk_max.argmax(dim=-1) * c  # (N,) first column of the winning chunk
    # columns of the winning chunk; past the vocabulary (ragged chunk) repeat the last column,
    # which sits earlier at its own place, so the first maximum is unchanged
    cols = (start.unsqueeze(1) + torch.arange(c, device=x.device)).clamp_max_(V - 1)  # (N, c)
    return start + x.gather(1, cols).argmax(dim=-1)


def _row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _rows_or_default(t: torch.Tensor | None, idx: torch.Tensor, default: float) -> torch.Tensor:
    """``t[idx]``, or a tensor of ``default`` when the batch has no such parameter (``t`` is None)."""
    if t is None:
        return torch.full((idx.numel(),), default, device=idx.device,
                          dtype=torch.int64 if isinstance(default, int) else torch.float32)
    return t.index_select(0, idx)


def _local_generators(md: SamplingMetadata, rows: list[int]) -> dict[int, torch.Generator]:
    """Generators of ``rows``, keyed by position within ``rows``."""
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
    """Repetition, then frequency and presence penalties, in place on float32 ``logits`` [N, V].

    Repetition (CTRL): for each distinct token of prompt + output, ``logit / p`` if the
    logit is > 0 else ``logit * p``. Frequency/presence (OpenAI):
    ``logit -= count_in_output * frequency + (count_in_output > 0) * presence``.
    Touches only the K (row, token) entries listed in ``metadata`` (sparse).
    """
    rows, toks = metadata.penalty_rows, metadata.penalty_token_ids
    vals = logits[rows, toks]
    rep = metadata.penalty_repetition
    vals = torch.where(vals > 0, vals / rep, vals * rep) - metadata.penalty_offsets
    logits[rows, toks] = vals


def top_k_top_p_candidates(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
                           ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The sorted candidates that top-k and then top-p keep, without sorting the vocabulary.

    Args:
        logits: float32 [R, V] (after temperature).
        top_k: int64 [R] with every entry < V (only the top ``max(top_k)`` logits are
            ranked), or None for rows with top-p and no top-k: their candidate width starts
            at 256 and grows ×8, a row leaving as soon as its top ``width`` tokens hold its
            nucleus (one host sync per width tried); rows needing more than 2,048 get
            their nucleus from :func:`_nucleus_by_threshold`.
        top_p: float32 [R] in (0, 1], 1 meaning off.

    Returns:
        Chunks ``(rows int64 [r], vals float32 [r, m], token_ids int64 [r, m])`` covering
        every row once: for those rows (indices into ``logits``), the top m logits in
        descending order with the excluded ones set to -inf, and their token ids (the
        wide-nucleus chunk has m = V in token order instead).

    Top-k keeps every token whose logit is >= the row's k-th largest. Top-p keeps sorted
    token j when the probability mass before it (renormalized over the top-k survivors)
    is < p: the smallest nucleus reaching p (Holtzman et al. 2019), and always the top
    token, so a tiny p is greedy.
    """
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
        if width > _TOP_P_MAX_SORTED_WIDTH:  # a wide nucleus: find it by its threshold instead
            vals = _nucleus_by_threshold(x, norm, p)
            chunks.append((rows, vals, torch.arange(V, device=x.device).expand_as(vals)))
            break
        vals, token_ids = x.topk(width, dim=-1, sorted=True)
        if width == V:
            covered = torch.ones_like(p, dtype=torch.bool)
        else:  # the top `width` tokens hold the nucleus when their mass reaches p
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
    """Logits [r, V] (token order) with tokens outside each row's top-p nucleus set to -inf.

    For nuclei of thousands of tokens, where ranking them costs more than finding the
    logprob threshold that bounds them: bisect per row for ``lo < hi`` with
    mass(logprob >= lo) >= p > mass(logprob >= hi) until at most
    ``_TOP_P_MAX_SORTED_WIDTH`` tokens lie in between, then rank only those. A row stops
    bisecting on its own count, so its result does not depend on the other rows.
    ``log_norm`` [r, 1]: the rows' logsumexp.
    """
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
        up = (mass >= top_p) & active  # the threshold may rise to mid
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
    """Full-vocabulary form of :func:`top_k_top_p_candidates`: logits [N, V] with excluded tokens at -inf.

    ``top_k`` int64 [N] (0, negative or >= V = off) or None; ``top_p`` float32 [N] (1 = off)
    or None. Rows with neither are returned unchanged. Syncs with the host (row grouping).
    """
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
    """Drop tokens with probability < min_p × max probability, in place (log space, no softmax).

    ``logits`` float32 [R, C] (a row's vocabulary or its sorted candidates), ``min_p``
    float32 [R]. ``p_i < min_p * p_max``  <=>  ``logit_i < max_logit + log(min_p)``;
    min_p = 0 keeps all, min_p = 1 keeps only the top token (and exact ties).
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    logits.masked_fill_(logits < threshold, float("-inf"))


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator],
                     token_ids: torch.Tensor | None = None, vocab_size: int | None = None) -> torch.Tensor:
    """Sample one position per row: ``argmax(probs / q)``, ``q ~ Exp(1)`` i.i.d.; int64 [R].

    Args:
        probs: float32 [R, C], rows summing to 1 (modified in place).
        generators: row -> the row's generator; other rows share one batched draw from
            torch's default generator.
        token_ids: int64 [R, C], the vocabulary id of each column when ``probs`` covers
            candidates only; a seeded row then draws ``vocab_size`` uniforms in token-id
            order and uses those of its candidates, so its draw is the same as over the
            full vocabulary and independent of the batch (candidate widths vary with it).
        vocab_size: V, required with ``token_ids``.

    ``q = -log(U)`` with ``U ~ Uniform[0, 1)`` (cheaper than ``exponential_`` on CPU; U < 1
    so q > 0; U = 0 gives q = inf, i.e. that token is not chosen). P(argmax = i) =
    probs[i]: the first of independent exponential clocks with rates probs[i] to ring
    (equivalent to the Gumbel-max trick).
    """
    q = torch.empty_like(probs)
    num_rows = probs.shape[0]
    if not generators:
        q.uniform_()
    elif len(generators) < num_rows:  # draw only for the unseeded rows
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
    """Prompt logprobs: the raw model distribution (log_softmax of the logits, no processing).

    Args:
        logits: float [P, V] — row j predicts ``target_ids[j]``.
        target_ids: int64 [P] — the actual next prompt tokens.
        k: how many top entries per position.

    Raises:
        ValueError: on mismatched shapes or k outside [0, V].
    """
    if logits.dim() != 2 or target_ids.shape != (logits.shape[0],):
        raise ValueError(f"logits [P, V] and target_ids [P] expected, got {tuple(logits.shape)} "
                         f"and {tuple(target_ids.shape)}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return LogprobsTensors.from_logprobs(logprobs, target_ids.to(torch.int64), k)
