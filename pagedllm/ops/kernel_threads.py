"""How many OpenMP threads an integer GEMM call (``native/gguf_repack.c``, ``native/int8_gemm.c``) asks for: one per
:func:`macs_per_thread` multiply-adds, at most torch's thread count.

Waking a sleeping OpenMP thread (``OMP_WAIT_POLICY=PASSIVE``, pagedllm's default) costs about what these kernels
spend on a few million multiply-adds, so the projections of a batch-1 step, and most of a batch-4 step's, run faster
on the calling thread alone. Spinning threads (ACTIVE, a machine pagedllm has to itself) start at once, so every
projection but the smallest splits: a batch-1 step is a read of the weights, and one thread reads at about half the
memory bandwidth of two. The constants were chosen by SmolLM2 decode tok/s (benchmarks/README.md, GGUF and W8A8
sections).
"""

from __future__ import annotations

import os

import torch

__all__ = ["ACTIVE_MACS_PER_THREAD", "PASSIVE_MACS_PER_THREAD", "macs_per_thread", "num_threads"]

PASSIVE_MACS_PER_THREAD = 1 << 22
ACTIVE_MACS_PER_THREAD = 1 << 18


def macs_per_thread() -> int:
    """Multiply-adds per thread: :data:`ACTIVE_MACS_PER_THREAD` when the process's ``OMP_WAIT_POLICY`` (read by
    libgomp when it loaded; pagedllm sets PASSIVE unless given) is ACTIVE, else :data:`PASSIVE_MACS_PER_THREAD`."""
    return ACTIVE_MACS_PER_THREAD if os.environ.get("OMP_WAIT_POLICY", "").upper() == "ACTIVE" \
        else PASSIVE_MACS_PER_THREAD


def num_threads(m: int, n: int, k: int, spinning: bool = False) -> int:
    """Threads for an (m, n, k) product (m rows, n outputs, k inputs): at least 1, at most torch's count.
    ``spinning``: for a team whose threads spin between calls (a CPU decode graph's native replay), whatever the
    wait policy: :data:`ACTIVE_MACS_PER_THREAD`."""
    per_thread = ACTIVE_MACS_PER_THREAD if spinning else macs_per_thread()
    return max(1, min(torch.get_num_threads(), m * n * k // per_thread))
