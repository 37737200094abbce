"""The GPU benchmarks' CPU-checkable parts: the random-weight model folder loads and generates,
and the peak-bandwidth table matches device names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_attention
    import gpu_throughput
    return gpu_attention, gpu_throughput


def test_random_llama_folder_loads_and_generates(bench, tmp_path):
    _, gpu_throughput = bench
    shape = dict(gpu_throughput.LLAMA_1B_SHAPE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                 max_position_embeddings=256)
    folder = gpu_throughput.random_llama_folder(tmp_path, shape)
    llm = LLM(model=str(folder), device="cpu", max_model_len=64, num_kv_blocks=16)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert all(0 <= t < 300 for t in out[0].outputs[0].token_ids)


def test_nominal_bandwidth_table(bench):
    gpu_attention, _ = bench
    assert gpu_attention.nominal_bandwidth("NVIDIA H200") == 4800
    assert gpu_attention.nominal_bandwidth("NVIDIA H100 80GB HBM3") == 3350
    assert gpu_attention.nominal_bandwidth("NVIDIA A100-SXM4-80GB") == 2039
    assert gpu_attention.nominal_bandwidth("Some Future GPU") is None
