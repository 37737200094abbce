"""pagedllm corrects LRU_CACHE_CAPACITY values that crash oneDNN before torch's CPU linears read them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedllm.runtime_env import DEFAULT_LRU_CACHE_CAPACITY, guard_lru_cache_capacity


@pytest.mark.parametrize("value", ["0", "", "abc", " 0x10", "+0"])
def test_capacity_read_as_zero_is_replaced_with_a_warning_naming_it(value):
    env = {"LRU_CACHE_CAPACITY": value}
    message = guard_lru_cache_capacity(env)
    assert env["LRU_CACHE_CAPACITY"] == str(DEFAULT_LRU_CACHE_CAPACITY)
    assert message is not None and "LRU_CACHE_CAPACITY" in message and repr(value) in message


@pytest.mark.parametrize("env", [{}, {"LRU_CACHE_CAPACITY": "1"}, {"LRU_CACHE_CAPACITY": "4096"},
                                 {"LRU_CACHE_CAPACITY": "-1"}, {"LRU_CACHE_CAPACITY": " 7x"}])
def test_other_values_are_left_alone(env):
    before = dict(env)
    assert guard_lru_cache_capacity(env) is None and env == before


def test_lru_cache_capacity_0_no_longer_crashes_the_first_packed_linear():
    """Without the guard this process dies with SIGSEGV (-11) in oneDNN's first linear."""
    code = ("import pagedllm, torch\n"  # pagedllm first, as the engine imports it
            "x, w = torch.randn(16, 32), torch.randn(64, 32)\n"
            "packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)\n"  # the engine's packed linear
            "y = torch.ops.mkldnn._linear_pointwise(x, packed, None, 'none', [], '')\n"
            "b = torch.nn.functional.linear(x.bfloat16(), w.bfloat16())\n"
            "torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4)\n"
            "print(tuple(y.shape), tuple(b.shape))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "LRU_CACHE_CAPACITY": "0"})
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.strip() == "(16, 64) (16, 64)"
    assert "LRU_CACHE_CAPACITY='0'" in r.stderr and "RuntimeWarning" in r.stderr
