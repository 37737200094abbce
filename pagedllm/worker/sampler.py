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
7. Temperature: random rows' logits are divided by their temperature (greedy rows hold
   temperature 1 and are never divided; temperatures below ``SAMPLING_EPS`` are greedy, so
   no row overflows to inf/NaN).
8. Logprobs (when any row asks): ``log_softmax`` of the logits at this point, i.e. the
   model distribution *after penalties, masks, bias and temperature, before top-k/top-p/
   min-p truncation* (issue 4: "after temperature and penalties"; greedy rows are at
   temperature 1). Masked tokens (-inf) are reported as ``LOGPROB_FLOOR`` so JSON never
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

Top-k and top-p avoid a full sort of the vocabulary when they can: they sort only the
top ``m`` logits of each row, where ``m`` covers every row's top-k, or, for top-p rows
without top-k, grows (×8) until the top ``m`` tokens hold each row's nucleus (one host
sync per try); rows that need no truncation are left untouched.
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
        apply_token_masks(logits, metadata)
        if not metadata.no_logit_bias:
            logits.index_put_((metadata.logit_bias_rows, metadata.logit_bias_token_ids),
                              metadata.logit_bias_values, accumulate=True)
        if not metadata.no_penalties:
            apply_penalties(logits, metadata)

        greedy_ids = None if metadata.all_random else logits.argmax(dim=-1)
        if not metadata.all_greedy:
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
    def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Truncate (top-k, top-p, min-p) and draw by the exponential race; int64 [N]."""
        if not (metadata.no_top_k and metadata.no_top_p):
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        if not metadata.no_min_p:
            apply_min_p(logits, metadata.min_p)
        probs = torch.softmax(logits, dim=-1)
        return exponential_race(probs, metadata.generators)


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
    """
    rep = metadata.repetition_penalties.unsqueeze(1)
    factor = torch.where(metadata.repetition_mask, rep, torch.ones_like(rep))
    torch.where(logits > 0, logits / factor, logits * factor, out=logits)
    counts = metadata.output_token_counts
    logits.sub_(metadata.frequency_penalties.unsqueeze(1) * counts)
    logits.sub_(metadata.presence_penalties.unsqueeze(1) * (counts > 0))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf what top-k and then top-p exclude; returns the masked logits [N, V].

    Args:
        logits: float32 [N, V] (after temperature).
        top_k: int64 [N] with V meaning off, or None.
        top_p: float32 [N] in (0, 1] with 1 meaning off, or None.

    Top-k keeps every token whose logit is >= the row's k-th largest (so ties at the
    threshold are kept, whatever the batch). Top-p keeps sorted token j when the
    probability mass before it (renormalized over the top-k survivors) is < p: the
    smallest nucleus reaching p, and always the top token, so a tiny p is greedy.
    """
    V = logits.shape[-1]
    if top_p is None:
        return _apply_top_k_only(logits, top_k)
    k = top_k if top_k is not None else torch.full_like(top_p, V, dtype=torch.int64)
    needs = (k < V) | (top_p < 1.0)
    has_k_bound = bool(((k < V) | (top_p >= 1.0)).all())
    max_active_k = int(torch.where(k < V, k, torch.ones_like(k)).max())
    width = max_active_k if has_k_bound else min(V, max(max_active_k, _TOP_P_FIRST_WIDTH))
    while True:
        vals, idx = logits.topk(width, dim=-1, sorted=True)  # (N, width), descending
        kth = vals.gather(1, (k.clamp(max=width) - 1).unsqueeze(1))
        vals = vals.masked_fill(vals < kth, float("-inf"))
        if width == V:
            norm = torch.logsumexp(vals, dim=-1, keepdim=True)
        else:
            # Rows without top-k renormalize over the full vocabulary, rows with it over their survivors.
            full = torch.logsumexp(logits, dim=-1, keepdim=True)
            norm = torch.where((k < V).unsqueeze(1), torch.logsumexp(vals, dim=-1, keepdim=True), full)
        probs = (vals - norm).exp()
        cum = probs.cumsum(dim=-1)
        if width < V and not has_k_bound:
            covered = (k < V) | (top_p >= 1.0) | (cum[:, -1] >= top_p)
            if not bool(covered.all()):
                width = min(V, width * 8)
                continue
        drop = (cum - probs >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        vals = vals.masked_fill(drop, float("-inf"))
        break
    out = torch.full_like(logits, float("-inf")).scatter_(1, idx, vals)
    return torch.where(needs.unsqueeze(1), out, logits)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k without a sort: threshold each row at its k-th largest logit (top_k [N], V = off)."""
    V = logits.shape[-1]
    active = top_k < V
    max_k = int(torch.where(active, top_k, torch.ones_like(top_k)).max())
    kth = logits.topk(max_k, dim=-1, sorted=True).values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))
    kth = kth.masked_fill(~active.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens with probability < min_p × max probability, in place (log space, no softmax).

    ``p_i < min_p * p_max``  <=>  ``logit_i < max_logit + log(min_p)``; min_p = 0 keeps all,
    min_p = 1 keeps only the top token (and exact ties).
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    logits.masked_fill_(logits < threshold, float("-inf"))


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row: ``argmax(probs / q)``, ``q ~ Exp(1)`` i.i.d.; int64 [N].

    ``q = -log(U)`` with ``U ~ Uniform[0, 1)`` (cheaper than ``exponential_`` on CPU and
    never 0, so no division by zero; U = 0 gives q = inf, i.e. that token is not chosen).
    One batched draw serves all rows; each row ``i`` in ``generators`` then redraws its own
    row from its generator, so its result depends only on its probabilities and its
    generator's state. P(argmax = i) = probs[i] (the race of exponential clocks with rates
    probs[i]; equivalent to the Gumbel-max trick).
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.uniform_()
    for i, gen in generators.items():
        q[i].uniform_(generator=gen)
    q.log_().neg_()
    return probs.div_(q).argmax(dim=-1)


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
