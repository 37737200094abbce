"""KV pool sizing from gpu_memory_utilization: the arithmetic on CPU, the measurement on CUDA."""

from __future__ import annotations

import pytest
import torch

from pagedllm.worker.memory_profiler import MemoryProfile

GIB = 2**30


def test_kv_pool_is_budget_minus_each_term():
    p = MemoryProfile(total_bytes=80 * GIB, utilization=0.9, weights_bytes=16 * GIB,
                      peak_activation_bytes=3 * GIB, graph_bytes=GIB // 2, other_bytes=GIB, profile_tokens=8192)
    assert p.budget_bytes == int(72 * GIB)
    assert p.kv_cache_bytes == int(72 * GIB) - 16 * GIB - 3 * GIB - GIB // 2 - GIB
    text = p.describe()
    for term in ("72.00 GiB", "weights 16.00 GiB", "peak activations 3.00 GiB", "8192 tokens",
                 "CUDA graphs 0.50 GiB", "other 1.00 GiB", "KV cache 51.50 GiB"):
        assert term in text, (term, text)


@pytest.mark.gpu
def test_engine_sizes_kv_pool_from_profile_on_cuda(random_model_dir):
    from pagedllm import LLM

    llm = LLM(model=str(random_model_dir), device="cuda", gpu_memory_utilization=0.3, max_model_len=512)
    runner = llm.llm_engine.runner
    profile = runner.memory_profile
    assert profile is not None and profile.weights_bytes > 0 and profile.peak_activation_bytes > 0
    assert profile.graph_bytes > 0  # decode graphs are on by default on CUDA
    assert runner.kv_spec.num_blocks == profile.kv_cache_bytes // runner.bytes_per_block()
    allocated = torch.cuda.memory_reserved()
    assert allocated <= profile.budget_bytes  # the engine stays inside its share
