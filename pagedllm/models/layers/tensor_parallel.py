"""Tensor-parallel linear and embedding layers (Megatron-LM, Shoeybi et al., 2019); the plain layer when
N == 1. Column-parallel layers hold their rows (KV heads replicated when fewer than N); row-parallel ones
their input columns, one all-reduce, the bias on rank 0; vocabulary layers ``ceil(vocab / N)`` rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.distributed.communication import all_gather, all_reduce
from pagedllm.distributed.parallel_state import get_tensor_parallel_rank, get_tensor_parallel_size, heads_per_rank
from pagedllm.models.layers.embedding import LMHead, VocabEmbedding
from pagedllm.models.layers.linear import Linear, MergedLinear


def _check_shape(tensor: torch.Tensor, param: torch.Tensor, axis: int, full: int) -> None:
    """Raise ValueError unless ``tensor`` is ``param``'s shape with ``full`` rows on ``axis``."""
    expected = list(param.shape)
    expected[axis] = full
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(tensor.shape)}, expected {tuple(expected)}")


def _split(size: int, what: str) -> int:
    tp = get_tensor_parallel_size()
    if size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the {size} {what}")
    return size // tp


class _MergedColumnParallel(MergedLinear):

    full_sizes: list[int]
    ranges: list[tuple[int, int]]

    def checkpoint_slice(self, tensor: torch.Tensor, param_name: str, shard: int | None) -> torch.Tensor:
        """This rank's rows of projection ``shard`` (``None``: the fused tensor). Raises ValueError for another
        shape."""
        param = getattr(self, param_name)
        _check_shape(tensor, param, 0, sum(self.full_sizes) if shard is None else self.full_sizes[shard])
        if shard is not None:
            start, rows = self.ranges[shard]
            return tensor.narrow(0, start, rows)
        parts = tensor.split(self.full_sizes, dim=0)
        return torch.cat([p.narrow(0, s, n) for p, (s, n) in zip(parts, self.ranges)], dim=0)


class MergedColumnParallelLinear(_MergedColumnParallel):
    """gate/up stacked, each split by rows: x (T, in) -> (T, sum(output_sizes) / N); ValueError when N does not
    divide."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        local = [_split(size, "output features of a column-parallel projection") for size in output_sizes]
        super().__init__(in_features, local, bias=bias)
        rank = get_tensor_parallel_rank()
        self.full_sizes = list(output_sizes)
        self.ranges = [(rank * n, n) for n in local]


class QKVParallelLinear(_MergedColumnParallel):
    """Fused q/k/v of this rank's heads: x (T, hidden) -> (T, (heads + 2 * kv_heads) * head_dim).
    Raises ValueError as :func:`heads_per_rank`."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False) -> None:
        heads, kv_heads = heads_per_rank(num_heads, num_kv_heads)
        super().__init__(hidden_size, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], bias=bias)
        tp, rank = get_tensor_parallel_size(), get_tensor_parallel_rank()
        # fewer KV heads than ranks: tp // num_kv_heads consecutive ranks share (replicate) one
        kv_first = rank // (tp // num_kv_heads) if num_kv_heads < tp else rank * kv_heads
        self.full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        q_range = (rank * heads * head_dim, heads * head_dim)
        kv_range = (kv_first * head_dim, kv_heads * head_dim)
        self.ranges = [q_range, kv_range, kv_range]


class RowParallelLinear(Linear):
    """x (T, in_features / N) -> (T, out_features), summed over the ranks; ValueError when N does not divide
    in_features."""

    # a scale spanning a whole output row (per-channel int8) reads it across the ranks
    input_is_parallel = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(_split(in_features, "input features of a row-parallel projection"), out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x))

    def checkpoint_slice(self, tensor: torch.Tensor, param_name: str, shard: int | None) -> torch.Tensor:
        """weight (out, in) -> this rank's columns (out, in / N); bias on rank 0, zeros elsewhere; other
        per-row vectors whole; ValueError otherwise."""
        param = getattr(self, param_name)
        _check_shape(tensor, param, -1, param.shape[-1] * (get_tensor_parallel_size() if param.dim() == 2 else 1))
        if param_name == "bias":
            return tensor if get_tensor_parallel_rank() == 0 else torch.zeros_like(tensor)
        if param.dim() == 1:  # one value per output row (a kept weight's per-channel scales): whole
            return tensor
        cols = param.shape[-1]  # in / N, or packed bytes of a kept-quantized weight
        return tensor.narrow(1, get_tensor_parallel_rank() * cols, cols)


class _VocabShard:
    """This rank's vocabulary rows ``[start, end)``; ``padded_rows`` = ceil(vocab / N) on every rank."""

    def __init__(self, vocab_size: int) -> None:
        tp, rank = get_tensor_parallel_size(), get_tensor_parallel_rank()
        self.vocab_size = vocab_size
        self.padded_rows = -(-vocab_size // tp)
        self.start = min(rank * self.padded_rows, vocab_size)
        self.end = min(self.start + self.padded_rows, vocab_size)

    def slice(self, tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """Rows ``[start, end)`` of a (vocab, hidden) tensor, zero-padded. Raises ValueError for another shape."""
        _check_shape(tensor, param, 0, self.vocab_size)
        rows = tensor.narrow(0, self.start, self.end - self.start)
        if rows.shape[0] == self.padded_rows:
            return rows
        return torch.cat([rows, rows.new_zeros(self.padded_rows - rows.shape[0], *rows.shape[1:])])


class VocabParallelEmbedding(VocabEmbedding):
    """ids (T,) int64 -> (T, hidden); this rank holds rows ``[start, end)`` of the vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None) -> None:
        self.vocab_shard = _VocabShard(vocab_size)
        super().__init__(self.vocab_shard.padded_rows, hidden_size, scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tensor_parallel_size() == 1:
            return super().forward(input_ids)
        mine = (input_ids >= self.vocab_shard.start) & (input_ids < self.vocab_shard.end)
        local = torch.where(mine, input_ids - self.vocab_shard.start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)  # other ranks' rows: 0
        out = all_reduce(out)
        if self.scale is not None:
            out = out * torch.tensor(self.scale, dtype=out.dtype)
        return out

    def checkpoint_slice(self, tensor: torch.Tensor, param_name: str, shard: int | None) -> torch.Tensor:
        return self.vocab_shard.slice(tensor, getattr(self, param_name))


class ParallelLMHead(LMHead):
    """hidden (R, hidden) -> logits (R, vocab) float32: columns all-gathered, padding dropped, then the soft cap."""

    def __init__(self, hidden_size: int, vocab_size: int, soft_cap: float | None = None) -> None:
        self.vocab_shard = _VocabShard(vocab_size)
        super().__init__(hidden_size, self.vocab_shard.padded_rows, soft_cap)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if get_tensor_parallel_size() == 1:
            return super().forward(hidden)
        logits = all_gather(Linear.forward(self, hidden), dim=-1)[:, :self.vocab_size]  # (N_rows, vocab)
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits.float()

    def checkpoint_slice(self, tensor: torch.Tensor, param_name: str, shard: int | None) -> torch.Tensor:
        return self.vocab_shard.slice(tensor, getattr(self, param_name))
