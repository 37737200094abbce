"""CUDA graphs for decode steps: static buffers, capture sizes, padding to a reserved block,
eager fallback (as vLLM; why: docs/engine.md). ``mode="pad"`` pads without graphs (CPU tests)."""

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
    """Runs decode-only steps through static buffers, padded to a captured size (replayed as graphs when
    ``use_graphs``); ``padding_block``: the reserved block padding rows write and read."""

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
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(num_groups, n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, _Graph] = {}

    def padded_size(self, num_reqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_reqs), None)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """A decode-only batch no larger than the largest size."""
        return (metadata.num_reqs > 0 and metadata.num_decodes == metadata.num_reqs
                and self.padded_size(metadata.num_reqs) is not None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: list[AttentionMetadata]) -> torch.Tensor:
        """Hidden states (n, hidden) of the n decode tokens, computed on the padded batch; only when
        :meth:`can_run`; a view valid until the next call."""
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
        return [AttentionMetadata(
            slot_mapping=self.slot_mapping[g, :size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[g, :size],
            num_decodes=size, num_decode_tokens=size, max_query_len=1, max_seq_len=max_seq_len,
            query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=seq_lens_cpu)
            for g in range(self.slot_mapping.shape[0])]

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture one graph per size, largest first, in one memory pool, after the KV cache is bound.
        Returns the device bytes they took."""
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
