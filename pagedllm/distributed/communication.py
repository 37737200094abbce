"""Collectives over the tensor-parallel group (Megatron-LM, Shoeybi et al., 2019); with one rank each
returns its input. Every collective on more than one rank is counted in :data:`COLLECTIVE_STATS`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.distributed.parallel_state import get_tensor_parallel_backend, get_tensor_parallel_size


@dataclass
class CollectiveStats:
    """Counters of one kind of collective on this rank (bytes: this rank's tensor)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.calls += 1
        self.bytes += nbytes
        self.seconds += seconds


COLLECTIVE_STATS = {"all_reduce": CollectiveStats(), "all_gather": CollectiveStats()}


def collective_stats() -> dict[str, dict]:
    """This rank's counters: ``{"all_reduce": {"calls", "bytes", "seconds"}, "all_gather": ...}``."""
    return {name: vars(stats).copy() for name, stats in COLLECTIVE_STATS.items()}


def reset_collective_stats() -> None:
    for name in COLLECTIVE_STATS:
        COLLECTIVE_STATS[name] = CollectiveStats()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Elementwise sum of ``x`` over the ranks (any shape, in place on ``x``); returns ``x``."""
    if get_tensor_parallel_size() == 1:
        return x
    start = time.perf_counter()
    dist.all_reduce(x)
    COLLECTIVE_STATS["all_reduce"].add(x.numel() * x.element_size(), time.perf_counter() - start)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum of ``x`` over the ranks (any shape, in place on ``x``); returns ``x``."""
    if get_tensor_parallel_size() == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order: (..., n, ...) -> (..., world_size * n, ...)."""
    size = get_tensor_parallel_size()
    if size == 1:
        return x
    start = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    COLLECTIVE_STATS["all_gather"].add(x.numel() * x.element_size(), time.perf_counter() - start)
    return torch.cat(parts, dim=dim)


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's ``value`` (e.g. the KV block count every rank can hold)."""
    if get_tensor_parallel_size() == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if get_tensor_parallel_backend() == "nccl" else None
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
