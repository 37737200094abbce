"""pagedllm/ops/calls.py: the fused kernels called through one reused struct per kernel and thread
give the results of the same kernel called with its argument list, when the scalar arguments change
between calls and when two threads call the same kernel at once (each thread has its own struct)."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from pagedllm.ops.library import cpu_ops
from pagedllm.ops.norm import fused_add_rms_norm_


@pytest.fixture(scope="module", autouse=True)
def ops():
    if cpu_ops() is None:
        pytest.skip("the fused CPU kernels did not build here")


def _check(rows: int, dim: int, eps: float, seed: int) -> None:
    """fused_add_rms_norm_ (the struct call) on (rows, dim) bfloat16 equals the kernel's
    argument-list call on copies, bit for bit; the sum is the torch add's."""
    g = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(rows, dim, generator=g).to(torch.bfloat16) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(dim, generator=g)).to(torch.bfloat16)
    total, expected, expected_sum = x + residual, x.clone(), residual.clone()
    cpu_ops().rms_norm[torch.bfloat16](expected.data_ptr(), None, expected_sum.data_ptr(), weight.data_ptr(),
                                       expected.data_ptr(), rows, dim, dim, dim, dim, eps, False, 1)
    assert fused_add_rms_norm_(x, residual, weight, eps, False)
    assert torch.equal(residual, total) and torch.equal(expected_sum, total) and torch.equal(x, expected)


def test_scalars_that_change_between_calls_are_rewritten():
    for i, (rows, dim, eps) in enumerate([(3, 64, 1e-6), (3, 64, 1e-6), (5, 128, 1e-6), (5, 128, 1e-5), (3, 64, 1e-6)]):
        _check(rows, dim, eps, seed=i)


def test_two_threads_each_use_their_own_struct():
    errors = []

    def work(rows: int, dim: int, first_seed: int) -> None:
        try:
            for i in range(first_seed, first_seed + 300):  # one shape, other data: the same scalars
                _check(rows, dim, 1e-6, seed=i)
        except AssertionError as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(4, 128, seed)) for seed in (0, 1000)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between almost every bytecode: interleave the calls
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors
