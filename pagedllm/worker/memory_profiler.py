"""Sizing the KV cache from ``gpu_memory_utilization`` by measuring a profiling forward (CUDA).

    KV pool = utilization × total − weights − peak activations − CUDA graphs − other

vLLM's scheme (``determine_available_memory``); what each term measures: docs/engine.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger("pagedllm")


@dataclass(frozen=True)
class MemoryProfile:
    """The start-up memory budget of one device, in bytes."""

    total_bytes: int
    utilization: float
    weights_bytes: int
    peak_activation_bytes: int
    graph_bytes: int
    other_bytes: int
    profile_tokens: int  # tokens of the profiling forward

    @property
    def budget_bytes(self) -> int:
        """``utilization × total``: what the engine may use."""
        return int(self.total_bytes * self.utilization)

    @property
    def kv_cache_bytes(self) -> int:
        """What is left for the KV pool (may be <= 0: the caller reports it)."""
        return (self.budget_bytes - self.weights_bytes - self.peak_activation_bytes - self.graph_bytes
                - self.other_bytes)

    def describe(self) -> str:
        gib = 2**30
        return (f"memory profile: {self.utilization:.2f} x {self.total_bytes / gib:.2f} GiB total = "
                f"{self.budget_bytes / gib:.2f} GiB; weights {self.weights_bytes / gib:.2f} GiB, "
                f"peak activations {self.peak_activation_bytes / gib:.2f} GiB (forward at {self.profile_tokens} "
                f"tokens), CUDA graphs {self.graph_bytes / gib:.2f} GiB, other {self.other_bytes / gib:.2f} GiB "
                f"(CUDA context, libraries) -> KV cache {self.kv_cache_bytes / gib:.2f} GiB")


def profile_memory(device: torch.device, utilization: float, profile_tokens: int,
                   run_profile_forward: Callable[[], None],
                   measure_graphs: Callable[[], int] | None) -> MemoryProfile:
    """Measure the terms of :class:`MemoryProfile` on a CUDA ``device``. Call after the weights
    load, before the KV cache exists, in a process holding nothing else on the device (all torch
    has allocated counts as weights)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_profile_forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    graphs = measure_graphs() if measure_graphs is not None else 0
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    other = max((total - free) - torch.cuda.memory_reserved(device), 0)
    return MemoryProfile(total_bytes=total, utilization=utilization, weights_bytes=weights,
                         peak_activation_bytes=max(peak - weights, 0), graph_bytes=graphs, other_bytes=other,
                         profile_tokens=profile_tokens)
