"""The draft-model proposer: a smaller model with the target's vocabulary drafts each request's
next tokens greedily, through its own model runner and its own paged KV cache.

Per request the draft cache holds the K/V of a token list (its *fed* tokens, positions 0..n-1).
Each step the fed list is cut to its longest common prefix with the request's tokens
(``Request.all_token_ids``: prompt + accepted output), which rolls back the K/V of rejected
drafts exactly as the target's is (the slots stay allocated and the next feed overwrites them);
the tokens after that prefix are fed as one query (the prompt's prefill the first time, else
the last accepted drafts and the target's token), the argmax of its last position is draft 1, and
each further draft is one batched decode step of the requests still drafting.

Drafts are greedy, so each is a point mass and the runner's "accept while the target's sample
equals the draft" rule is exact rejection sampling at every temperature: the output is the
target's (greedy) or distributed as the target's (sampling).

The cache has the target's pool size in blocks plus ``cdiv(k, block_size)`` per sequence for the
draft positions past the target's tokens; its bytes and the draft's weights are logged at start-up.
A request whose blocks cannot be had drafts nothing that step. The wall time of the draft's decode
steps, per request, is the proposer's :meth:`seconds_per_draft_token` (an exponential average),
which the drafter adds to a draft position's cost: a draft model too slow for its acceptance
drafts nothing. Blocks go back to the free list
when the request stops running (finished, aborted or preempted: :meth:`forget`).
Engine thread only; rank 0's device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.config import EngineConfig, SpeculativeConfig
from pagedllm.core.request import Request
from pagedllm.sizing import format_bytes
from pagedllm.spec_decode.proposer import Proposer
from pagedllm.utils import cdiv

logger = logging.getLogger("pagedllm")

COST_DECAY = 0.8  # weight of the previous estimate of a draft token's cost, per measured decode step


@dataclass
class _DraftSequence:
    """One request's state in the draft cache."""

    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # fed tokens: their K/V is in the draft cache


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def draft_engine_config(config: EngineConfig, spec: SpeculativeConfig, num_blocks: int) -> EngineConfig:
    """The draft runner's config: the target's device, dtype, block size, lengths and seed; the
    draft's model; float weights, eager, one rank, no speculation of its own."""
    return config.replace(model=spec.model, tokenizer=config.tokenizer or config.model, speculative_config=None,
                          quantization=None, compilation_config=None, num_kv_blocks=num_blocks,
                          tensor_parallel_size=1)


class DraftModelProposer(Proposer):
    """Drafts with ``spec.model``. Raises ValueError naming ``speculative_config.model`` when its
    vocabulary size differs from the target's (``target_vocab_size``), and for
    ``tensor_parallel_size > 1``; ``target_num_blocks`` sizes the draft cache."""

    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, target_vocab_size: int,
                 target_num_blocks: int) -> None:
        from pagedllm.loader import load_model_files
        from pagedllm.worker.model_runner import ModelRunner

        if config.tensor_parallel_size > 1:
            raise ValueError("speculative_config.method 'draft_model' does not run with tensor_parallel_size > 1; "
                             "use ngram or suffix there")
        files = load_model_files(spec.model, config.tokenizer or config.model)
        vocab = int(files.hf_config.vocab_size)
        if vocab != target_vocab_size:
            raise ValueError(f"speculative_config.model {spec.model!r} has vocab_size {vocab}, the target "
                             f"{config.model!r} has {target_vocab_size}: a draft model must share the tokenizer")
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.token_budget = config.token_budget
        self.vocab_size = vocab
        self.num_blocks = target_num_blocks + config.max_num_seqs * cdiv(spec.num_speculative_tokens, self.block_size)
        self.runner = ModelRunner(draft_engine_config(config, spec, self.num_blocks), files)
        self._allocate_cache()
        self._free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self._seqs: dict[str, _DraftSequence] = {}
        self._seconds_per_token = 0.0  # measured on the draft's decode steps; 0 until the first

    def _allocate_cache(self) -> None:
        """The draft's KV cache (no collectives, no graphs to capture: rank 0 alone)."""
        r = self.runner
        r._layout_kv_cache()
        r.kv_caches = r._new_kv_caches(self.num_blocks)
        r.kv_scales = r._new_kv_scales(self.num_blocks)
        r._bind_kv_caches(r.kv_caches, r.kv_scales)
        self.kv_cache_bytes = self.num_blocks * r.bytes_per_block()
        logger.info("draft model %s: weights %s, KV cache %d blocks (%s) beside the target's pool",
                    r.config.model, format_bytes(r.weight_bytes()), self.num_blocks, format_bytes(self.kv_cache_bytes))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def seconds_per_draft_token(self) -> float:
        return self._seconds_per_token

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        return self.propose_batch([request], [num_tokens])[0]

    def propose_batch(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[tuple[int, _DraftSequence, int]] = []  # (index, sequence, draft length)
        for i, (req, n) in enumerate(zip(requests, num_tokens)):
            n = min(n, self.max_model_len - req.num_tokens)
            if n <= 0:
                continue
            seq = self._sync(req)
            n = self._reserve(req.request_id, seq, req.num_tokens, n)
            if n > 0:
                active.append((i, seq, n))
        if not active:
            return drafts
        first = self._feed([(seq, requests[i].all_token_ids[len(seq.token_ids):]) for i, seq, _ in active])
        for (i, _, _), token in zip(active, first):
            drafts[i].append(token)
        for j in range(1, max(n for _, _, n in active)):
            step = [(i, seq) for i, seq, n in active if n > j]
            t0 = time.perf_counter()
            tokens = self._feed([(seq, [drafts[i][-1]]) for i, seq in step])
            self._observe_cost((time.perf_counter() - t0) / len(step))
            for (i, _), token in zip(step, tokens):
                drafts[i].append(token)
        return drafts

    def _observe_cost(self, seconds: float) -> None:
        prev = self._seconds_per_token
        self._seconds_per_token = seconds if prev == 0.0 else COST_DECAY * prev + (1 - COST_DECAY) * seconds

    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._free_blocks.extend(reversed(seq.block_ids))

    def _sync(self, req: Request) -> _DraftSequence:
        """The request's sequence with its fed tokens cut to the common prefix with its tokens,
        leaving at least the last token to feed."""
        seq = self._seqs.setdefault(req.request_id, _DraftSequence())
        tokens = req.all_token_ids
        keep = min(common_prefix_length(seq.token_ids, tokens), len(tokens) - 1)
        del seq.token_ids[keep:]
        return seq

    def _reserve(self, request_id: str, seq: _DraftSequence, num_tokens: int, n: int) -> int:
        """Blocks for ``n`` drafts after ``num_tokens`` tokens (positions up to num_tokens + n - 2
        are written); fewer drafts when the pool is short, 0 (and the sequence dropped) when none fit."""
        while n > 0:
            need = cdiv(num_tokens + n - 1, self.block_size) - len(seq.block_ids)
            if need <= len(self._free_blocks):
                for _ in range(max(need, 0)):
                    seq.block_ids.append(self._free_blocks.pop())
                return n
            n -= 1
        self.forget(request_id)
        return 0

    def _feed(self, entries: list[tuple[_DraftSequence, list[int]]]) -> list[int]:
        """Feed each sequence its query tokens (appended to its fed tokens); per entry, the argmax
        of the last position. Forwards hold at most the token budget (a longer query goes alone)."""
        out: list[int] = [0] * len(entries)
        group: list[int] = []
        size = 0
        for e, (_, query) in enumerate(entries):
            if group and size + len(query) > self.token_budget:
                self._forward_group(entries, group, out)
                group, size = [], 0
            group.append(e)
            size += len(query)
        self._forward_group(entries, group, out)
        return out

    @torch.inference_mode()
    def _forward_group(self, entries: list[tuple[_DraftSequence, list[int]]], group: list[int],
                       out: list[int]) -> None:
        group = sorted(group, key=lambda e: len(entries[e][1]) > 1)  # decodes first, as the metadata requires
        seqs = [entries[e][0] for e in group]
        queries = [entries[e][1] for e in group]
        num_sched = np.array([len(q) for q in queries], dtype=np.int64)
        num_computed = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
        cu = np.zeros(len(group) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=cu[1:])
        req_idx = np.repeat(np.arange(len(group)), num_sched)
        positions = np.arange(int(cu[-1]), dtype=np.int64) - cu[req_idx] + num_computed[req_idx]
        seq_lens = num_computed + num_sched
        max_blocks = int(cdiv(int(seq_lens.max()), self.block_size))
        table = np.zeros((len(group), max_blocks), dtype=np.int64)
        for b, s in enumerate(seqs):
            used = s.block_ids[:max_blocks]
            table[b, :len(used)] = used
        slot_mapping = table[req_idx, positions // self.block_size] * self.block_size + positions % self.block_size
        r = self.runner
        dev = r.device
        num_decodes = int((num_sched == 1).sum())
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(table.astype(np.int32)).to(dev),
            num_decodes=num_decodes, num_decode_tokens=num_decodes,
            max_query_len=int(num_sched.max()), max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=cu.tolist(), seq_lens_cpu=seq_lens.tolist())
        input_ids = torch.tensor([t for q in queries for t in q], dtype=torch.int64, device=dev)
        hidden = r._forward(input_ids, torch.from_numpy(positions).to(dev), [meta] * len(r.kv_cache_groups))
        last = torch.from_numpy(cu[1:] - 1).to(dev)
        logits = r.model.compute_logits(hidden.index_select(0, last))[:, :self.vocab_size]
        for e, s, q, token in zip(group, seqs, queries, logits.argmax(dim=-1).tolist()):
            s.token_ids.extend(q)
            out[e] = int(token)
