"""SamplingMetadata: one step's sampling parameters as tensors, one row per sampling request.

Rows follow the order of the logits handed to the sampler; batch-wide flags (``all_greedy``,
``no_top_p``, ...) let it skip stages without a device sync. Row conventions: docs/engine.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from pagedllm.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class SamplingMetadata:
    """Sampling parameters of N rows over V tokens; tensors on the logits' device.

    ``temperature`` float32 [N] (1.0 for greedy rows), ``is_greedy`` bool [N]; ``top_k`` int64
    [N] (V where off), ``top_p`` float32 [N] (1.0 off), ``min_p`` float32 [N] (0.0 off), each
    None when no row uses it. Sparse (row, token) entries: ``penalty_*`` [K] (offsets =
    count_in_output × frequency + (count > 0) × presence), ``logit_bias_*`` [B], ``blocked_*``
    [M] (bad words; EOS and stop ids below min_tokens); ``disallowed_mask`` bool [A, V] for the
    ``allowed_rows`` [A]; each None when unused. ``generators``: row -> seeded generator (on the
    logits' device). ``top_k_rows``, ``top_p_only_rows``, ``untruncated_rows``: the random rows,
    ascending, by how they are truncated.
    """

    temperature: torch.Tensor
    is_greedy: torch.Tensor
    all_greedy: bool
    all_random: bool
    no_temperature: bool  # every row's temperature is 1.0: skip the division
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None
    no_penalties: bool
    penalty_rows: torch.Tensor | None
    penalty_token_ids: torch.Tensor | None
    penalty_repetition: torch.Tensor | None
    penalty_offsets: torch.Tensor | None
    no_logit_bias: bool
    logit_bias_rows: torch.Tensor | None
    logit_bias_token_ids: torch.Tensor | None
    logit_bias_values: torch.Tensor | None
    allowed_rows: torch.Tensor | None
    disallowed_mask: torch.Tensor | None
    blocked_rows: torch.Tensor | None
    blocked_token_ids: torch.Tensor | None
    vocab_size: int
    num_logprobs_per_row: list[int | None] = field(default_factory=list)
    top_k_rows: list[int] = field(default_factory=list)
    top_p_only_rows: list[int] = field(default_factory=list)
    untruncated_rows: list[int] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: list[int | None],
        vocab_size: int,
        device: torch.device | str,
    ) -> "SamplingMetadata":
        """Batch the N sampling rows (generators kept across steps by the caller). Raises ValueError
        naming the argument for lists of different lengths or a token id outside the vocabulary."""
        n = len(params)
        for name, lst in (("prompt_token_ids", prompt_token_ids), ("output_token_ids", output_token_ids),
                          ("generators", generators), ("eos_token_ids", eos_token_ids)):
            if len(lst) != n:
                raise ValueError(f"{name} has {len(lst)} rows, params has {n}")
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
        device = torch.device(device)
        V = vocab_size

        greedy = [p.is_greedy for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        temps = [1.0 if p.temperature < SAMPLING_EPS else float(p.temperature) for p in params]
        temperature = f32(temps)
        is_greedy = torch.tensor(greedy, dtype=torch.bool, device=device)

        top_k = top_p = min_p = None
        groups = ([], [], [])
        if not all_greedy:
            ks = [V if g or p.top_k <= 0 or p.top_k >= V else p.top_k for p, g in zip(params, greedy)]
            ps = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
            mps = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
            if any(k < V for k in ks):
                top_k = torch.tensor(ks, dtype=torch.int64, device=device)
            if any(x < 1.0 for x in ps):
                top_p = f32(ps)
            if any(x > 0.0 for x in mps):
                min_p = f32(mps)
            for i, g in enumerate(greedy):
                if not g:
                    groups[0 if ks[i] < V else 1 if ps[i] < 1.0 else 2].append(i)

        gens = {i: g for i, (g, is_g) in enumerate(zip(generators, greedy)) if g is not None and not is_g}
        nums = [p.logprobs for p in params]
        requested = [x for x in nums if x is not None]
        max_num_logprobs = max(requested) if requested else None

        pen = _build_penalties(params, prompt_token_ids, output_token_ids, V, device)
        bias = _build_logit_bias(params, V, device)
        allowed = _build_allowed(params, V, device)
        blocked = _build_blocked(params, output_token_ids, eos_token_ids, V, device)

        return cls(
            temperature=temperature, is_greedy=is_greedy, all_greedy=all_greedy, all_random=all_random,
            no_temperature=all(t == 1.0 for t in temps),
            top_k=top_k, top_p=top_p, min_p=min_p, generators=gens, max_num_logprobs=max_num_logprobs,
            no_penalties=pen is None,
            penalty_rows=pen[0] if pen else None, penalty_token_ids=pen[1] if pen else None,
            penalty_repetition=pen[2] if pen else None, penalty_offsets=pen[3] if pen else None,
            no_logit_bias=bias is None,
            logit_bias_rows=bias[0] if bias else None, logit_bias_token_ids=bias[1] if bias else None,
            logit_bias_values=bias[2] if bias else None,
            allowed_rows=allowed[0] if allowed else None, disallowed_mask=allowed[1] if allowed else None,
            blocked_rows=blocked[0] if blocked else None, blocked_token_ids=blocked[1] if blocked else None,
            vocab_size=V, num_logprobs_per_row=nums,
            top_k_rows=groups[0], top_p_only_rows=groups[1], untruncated_rows=groups[2],
        )


def _check_ids(name: str, ids: list[int], vocab_size: int) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name} contains token id {t}, outside the vocabulary [0, {vocab_size})")


def _row_token_index(rows_tokens: list[tuple[int, list[int]]], device: torch.device, name: str,
                     vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[(row, [tok, ...]), ...] as (rows, token_ids) int64 tensors; ValueError naming ``name``
    for a token id outside ``[0, vocab_size)``."""
    lengths = [len(toks) for _, toks in rows_tokens]
    rows = torch.repeat_interleave(torch.tensor([r for r, _ in rows_tokens], dtype=torch.int64),
                                   torch.tensor(lengths, dtype=torch.int64))
    toks = torch.tensor(list(itertools.chain.from_iterable(t for _, t in rows_tokens)), dtype=torch.int64)
    bad = (toks < 0) | (toks >= vocab_size)
    if bool(bad.any()):
        tok = int(toks[bad][0])
        raise ValueError(f"{name} contains token id {tok}, outside the vocabulary [0, {vocab_size})")
    return rows.to(device), toks.to(device)


def _build_penalties(params, prompt_token_ids, output_token_ids, V, device):
    """(rows, token ids int64 [K], repetition, offsets float32 [K]) or None: one entry per distinct
    (row, token) of the output and, with a repetition penalty, the prompt."""
    uses_freq = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
    uses_rep = [p.repetition_penalty != 1.0 for p in params]
    if not any(uses_freq) and not any(uses_rep):
        return None
    n = len(params)
    out_rows = [(i, output_token_ids[i]) for i in range(n) if (uses_freq[i] or uses_rep[i]) and output_token_ids[i]]
    prompt_rows = [(i, prompt_token_ids[i]) for i in range(n) if uses_rep[i] and prompt_token_ids[i]]
    cpu = torch.device("cpu")
    parts = []  # (rows, token ids, 1.0 for an output occurrence / 0.0 for a prompt one)
    if out_rows:
        r, t = _row_token_index(out_rows, cpu, "output_token_ids", V)
        parts.append((r, t, torch.ones(t.numel())))
    if prompt_rows:
        r, t = _row_token_index(prompt_rows, cpu, "prompt_token_ids", V)
        parts.append((r, t, torch.zeros(t.numel())))
    if not parts:
        return None
    keys = torch.cat([r * V + t for r, t, _ in parts])
    keys, inverse = torch.unique(keys, return_inverse=True)
    counts = torch.zeros(keys.numel()).scatter_add_(0, inverse, torch.cat([w for _, _, w in parts]))
    rows, toks = keys // V, keys % V
    presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)[rows]
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)[rows]
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)[rows]
    offsets = counts * frequency + (counts > 0) * presence
    return rows.to(device), toks.to(device), repetition.to(device), offsets.to(device)


def _build_logit_bias(params, V, device):
    """(rows int64 [B], token ids int64 [B], values float32 [B]) or None."""
    rows, toks, vals = [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            _check_ids("logit_bias", list(p.logit_bias), V)
            rows.extend([i] * len(p.logit_bias))
            toks.extend(p.logit_bias.keys())
            vals.extend(p.logit_bias.values())
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(toks, dtype=torch.int64, device=device),
            torch.tensor(vals, dtype=torch.float32, device=device))


def _build_allowed(params, V, device):
    """(rows int64 [A], disallowed bool [A, V]) for rows with allowed_token_ids, or None."""
    rows_tokens = [(i, list(p.allowed_token_ids)) for i, p in enumerate(params) if p.allowed_token_ids]
    if not rows_tokens:
        return None
    mask = torch.ones(len(rows_tokens), V, dtype=torch.bool)
    local = [(j, toks) for j, (_, toks) in enumerate(rows_tokens)]
    r, t = _row_token_index(local, torch.device("cpu"), "allowed_token_ids", V)
    mask[r, t] = False
    rows = torch.tensor([i for i, _ in rows_tokens], dtype=torch.int64, device=device)
    return rows, mask.to(device)


def _banned_by_bad_words(bad_words_token_ids: list[list[int]], output: list[int]) -> list[int]:
    """Last tokens of bad words whose prefix ends ``output`` (one-token ones always; vLLM's rule)."""
    banned = []
    for seq in bad_words_token_ids:
        if not seq:
            continue
        prefix = seq[:-1]
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix):
            banned.append(seq[-1])
    return banned


def _build_blocked(params, output_token_ids, eos_token_ids, V, device):
    """(rows int64 [M], token ids int64 [M]) to mask to -inf (bad words, min_tokens), or None."""
    rows_tokens = []
    for i, p in enumerate(params):
        toks = _banned_by_bad_words(p.bad_words_token_ids, output_token_ids[i]) if p.bad_words_token_ids else []
        if len(output_token_ids[i]) < p.min_tokens:
            if eos_token_ids[i] is not None and not p.ignore_eos:
                toks.append(eos_token_ids[i])
            toks.extend(p.stop_token_ids or [])
        if toks:
            rows_tokens.append((i, toks))
    if not rows_tokens:
        return None
    return _row_token_index(rows_tokens, device, "bad_words_token_ids/stop_token_ids/eos_token_ids", V)
