"""The integer GEMMs' thread count (pagedllm/ops/kernel_threads.py) follows the OpenMP wait policy."""

from __future__ import annotations

import torch

from pagedllm.ops import kernel_threads


def test_threads_follow_the_wait_policy(monkeypatch):
    """Sleeping threads (PASSIVE) are woken only for millions of multiply-adds, spinning ones (ACTIVE) for a
    batch-1 projection of the default model (1536 x 576)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert kernel_threads.num_threads(1, 1536, 576) == 1 and kernel_threads.num_threads(32, 1536, 576) == 2
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert kernel_threads.num_threads(1, 1536, 576) == 2 and kernel_threads.num_threads(1, 64, 64) == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert kernel_threads.num_threads(64, 3072, 576) == 1
