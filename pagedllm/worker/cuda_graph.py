"""CUDA graphs for decode steps: static buffers, capture sizes, padding, eager fallback.

At small batch a GPU decode step is launch-bound: a few hundred small kernels whose launch
overhead on the host exceeds their run time. A CUDA graph records the step's kernels once
and replays them with one launch. A graph replays fixed addresses and fixed launch shapes,
so (as in vLLM):

- every input lives in a **static buffer** (token ids, positions, query_start_loc,
  seq_lens, and per KV-cache group the slot mapping and block tables) sized for the largest
  captured batch; a step copies its inputs into the buffers' first rows;
- graphs are captured for a few **batch sizes** (1, 2, 4, 8, 16, 32, ... and
  ``max_num_seqs``); a decode batch of n requests is **padded** to the smallest captured
  size >= n. A padding row is a one-token request at position 0 whose K/V go to a reserved
  *padding block* (one block past the scheduler's pool, never handed out) and that attends
  to that block only: every backend handles it like any request, and it cannot touch a
  real request's cache;
- batches with a prefill, and decode batches larger than the largest size, run **eagerly**;
  ``enforce_eager=True`` (vLLM's name) turns graphs off altogether.

The same buffers and padding are used with graphs off (``mode="pad"``), which is how the
padding logic is tested on CPU: the padded step must give the unpadded step's outputs.

The metadata a graph was captured with carries host-side values the backend reads at
capture time (request count, longest query 1, longest context = ``max_model_len`` so the
Triton backend picks its split-KV layout for any context); only backends whose launches
depend on nothing else (``supports_cuda_graphs``) are captured.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from pagedllm.attention.backend import AttentionMetadata, set_forward_context

logger = logging.getLogger("pagedllm")

GraphMode = str  # "off": eager, unpadded; "pad": padded through the static buffers, eager; "graphs": captured


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def cuda_graph_mode(enforce_eager: bool, device: torch.device, backend: object) -> GraphMode:
    """``graphs`` on CUDA with a graph-safe attention backend unless ``enforce_eager``, else ``off``."""
    if enforce_eager or device.type != "cuda" or not getattr(backend, "supports_cuda_graphs", False):
        return "off"
    return "graphs"


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    hidden: torch.Tensor  # (size, hidden_size): the captured forward's output, rewritten by each replay


class DecodeGraphRunner:
    """Runs decode-only steps through static buffers, padded to a captured size (and replayed as CUDA graphs).

    Args:
        model: ``forward(input_ids, positions) -> (T, hidden)`` reading the forward context.
        sizes: capture sizes, ascending (:func:`capture_sizes`).
        num_groups: KV-cache groups (one metadata per group, see ``set_forward_context``).
        max_blocks_per_seq: block-table width.
        block_size: tokens per block.
        padding_block: physical id of the reserved block padding rows write and read.
        max_model_len: the longest context (the captured metadata's ``max_seq_len``).
        device: where the buffers live.
        use_graphs: capture and replay (CUDA); False = the same buffers and padding, run eagerly.
    """

    def __init__(self, model: Callable[..., torch.Tensor], sizes: list[int], max_blocks_per_seq: int,
                 block_size: int, padding_block: int, max_model_len: int, device: torch.device,
                 use_graphs: bool, num_groups: int = 1) -> None:
        self.model = model
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.padding_block = padding_block
        self.max_model_len = max_model_len
        self.use_graphs = use_graphs
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(num_groups, n, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token per request
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(num_groups, n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, _Graph] = {}

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest size >= ``num_reqs``, or None when the batch is larger than every size."""
        return next((s for s in self.sizes if s >= num_reqs), None)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """A decode-only batch (one query token per request) no larger than the largest size."""
        return (metadata.num_reqs > 0 and metadata.num_decodes == metadata.num_reqs
                and self.padded_size(metadata.num_reqs) is not None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: list[AttentionMetadata]) -> torch.Tensor:
        """Hidden states (n, hidden) of the n decode tokens, computed on the padded batch.

        ``metadata``: the step's metadata per KV-cache group. Call only when :meth:`can_run`;
        the returned tensor is a view of a graph's output buffer, valid until the next call.
        """
        n = metadata[0].num_reqs
        size = self.padded_size(n)
        self._fill(input_ids, positions, metadata, size)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.graph.replay()
            return graph.hidden[:n]
        seq_lens_cpu = list(metadata[0].seq_lens_cpu) + [1] * (size - n)
        with set_forward_context(self._metadata(size, max(seq_lens_cpu), seq_lens_cpu)):
            return self.model(self.input_ids[:size], self.positions[:size])[:n]

    def _fill(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: list[AttentionMetadata],
              size: int) -> None:
        """Copy a step's n rows into the buffers; rows n..size become padding rows."""
        n = metadata[0].num_reqs
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.seq_lens[:n].copy_(metadata[0].seq_lens, non_blocking=True)
        for g, meta in enumerate(metadata):
            self.slot_mapping[g, :n].copy_(meta.slot_mapping, non_blocking=True)
            self.block_tables[g, :n, :meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        self._pad(n, size)

    def _pad(self, start: int, end: int) -> None:
        """Rows start..end: a one-token request at position 0 in the padding block."""
        if start >= end:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[:, start:end] = self.padding_block * self.block_size
        self.seq_lens[start:end] = 1
        self.block_tables[:, start:end, 0] = self.padding_block

    def _metadata(self, size: int, max_seq_len: int, seq_lens_cpu: list[int]) -> list[AttentionMetadata]:
        """Per KV-cache group, metadata over the buffers' first ``size`` rows (views: a replay
        reads the current contents)."""
        return [AttentionMetadata(
            slot_mapping=self.slot_mapping[g, :size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[g, :size],
            num_decodes=size, num_decode_tokens=size, max_query_len=1, max_seq_len=max_seq_len,
            query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=seq_lens_cpu)
            for g in range(self.slot_mapping.shape[0])]

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture one graph per size, largest first, sharing one memory pool (CUDA only).

        Call after the KV cache is bound (graphs record its addresses). Returns the bytes of
        device memory the graphs took (free memory before minus after).
        """
        if not self.use_graphs:
            return 0
        free_before, _ = torch.cuda.mem_get_info()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._pad(0, size)
            # capture-time host values: every row a decode, contexts up to max_model_len
            meta = self._metadata(size, self.max_model_len, [self.max_model_len] * size)
            with set_forward_context(meta):
                self.model(self.input_ids[:size], self.positions[:size])  # warm-up: compile, autotune
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self.model(self.input_ids[:size], self.positions[:size])
            self.graphs[size] = _Graph(graph, hidden)
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        used = max(free_before - free_after, 0)
        logger.info("CUDA graphs: captured decode batch sizes %s, %.1f MiB", self.sizes, used / 2**20)
        return used
