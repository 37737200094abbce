"""Decode CUDA-graph bucketing on CPU: the static buffers and padding with graphs off.

A decode batch padded to the next capture size must give the unpadded batch's outputs and
leave every real block of the KV cache exactly as the unpadded step does (padding rows
write only the reserved padding block). Capture itself needs a GPU (marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention import TorchPagedAttention
from pagedllm.attention.backend import set_forward_context
from pagedllm.worker.cuda_graph import DecodeGraphRunner, capture_sizes, cuda_graph_mode
from tests.model_utils import allocate_block_tables, make_llama_pair, make_metadata, tiny_llama_config


def test_capture_sizes():
    assert capture_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert capture_sizes(1) == [1]


def test_graph_mode():
    class GraphSafe:
        supports_cuda_graphs = True

    cuda = torch.device("cuda")
    assert cuda_graph_mode(False, cuda, GraphSafe()) == "graphs"
    assert cuda_graph_mode(True, cuda, GraphSafe()) == "off"  # enforce_eager
    assert cuda_graph_mode(False, cuda, TorchPagedAttention()) == "off"  # host-side plan per step
    assert cuda_graph_mode(False, torch.device("cpu"), GraphSafe()) == "off"


def test_padded_decode_step_equals_unpadded():
    """5 decodes padded to 8 rows: same hidden states, same cache outside the padding block."""
    _, model = make_llama_pair(tiny_llama_config(), seed=2)
    contexts, block_size = [3, 17, 40, 1, 64], 16
    tables, num_blocks = allocate_block_tables([c + 1 for c in contexts], block_size, seed=2)
    padding_block = num_blocks  # one past the pool
    g = torch.Generator().manual_seed(2)
    cache_shape = (2, num_blocks + 1, block_size, model.num_kv_heads, model.head_dim)
    caches = [torch.randn(cache_shape, generator=g) for _ in range(model.num_layers)]
    meta = make_metadata(contexts, [1] * 5, tables, block_size)
    ids = torch.randint(0, 512, (5,), generator=g)
    positions = torch.tensor(contexts)

    model.bind_kv_caches(unpadded_caches := [c.clone() for c in caches])
    with torch.inference_mode(), set_forward_context(meta):
        expected = model(ids, positions)

    model.bind_kv_caches(caches)
    runner = DecodeGraphRunner(model, [1, 2, 4, 8], max_blocks_per_seq=8, block_size=block_size,
                               padding_block=padding_block, max_model_len=128, device=torch.device("cpu"),
                               use_graphs=False)
    assert runner.can_run(meta) and runner.padded_size(5) == 8 and runner.padded_size(9) is None
    with torch.inference_mode():
        hidden = runner.run(ids, positions, [meta])
    assert hidden.shape == expected.shape
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=0)
    for padded, unpadded in zip(caches, unpadded_caches):
        assert torch.equal(padded[:, :padding_block], unpadded[:, :padding_block])
        assert not torch.equal(padded[:, padding_block], unpadded[:, padding_block])  # padding rows wrote there
    assert runner.seq_lens[5:].tolist() == [1, 1, 1]
    assert runner.block_tables[0, 5:, 0].tolist() == [padding_block] * 3
    prefill = make_metadata([0, 3], [1, 4], tables[:2], block_size)
    assert not runner.can_run(prefill)  # a prefill in the batch: eager


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (5, 33, 12, 70, 2)]


def _run(model_dir, prompts):
    llm = LLM(model=str(model_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=6)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=2) for m in (9, 3, 12, 6, 7)]
    return llm, llm.generate(prompts, params, use_tqdm=False)


def test_engine_greedy_with_padded_decode_equals_eager(random_model_dir, prompts, monkeypatch):
    """Through the engine: decode batches of 5, 4, 3, 2, 1 requests padded to 6, 4, 4, 2, 1 rows."""
    _, reference = _run(random_model_dir, prompts)
    monkeypatch.setattr("pagedllm.worker.model_runner.cuda_graph_mode", lambda *args: "pad")
    padded_sizes = []
    run = DecodeGraphRunner.run

    def spy(self, input_ids, positions, metas):
        padded_sizes.append((metas[0].num_reqs, self.padded_size(metas[0].num_reqs)))
        return run(self, input_ids, positions, metas)

    monkeypatch.setattr(DecodeGraphRunner, "run", spy)
    llm, outputs = _run(random_model_dir, prompts)
    assert {(5, 6), (4, 4), (3, 4), (1, 1)} <= set(padded_sizes)
    runner = llm.llm_engine.runner
    assert runner.decode_graphs is not None and runner.decode_graphs.sizes == [1, 2, 4, 6]
    assert runner.kv_caches[0].shape[1] == 64 + 1  # the padding block, past the scheduler's 64
    for out, ref in zip(outputs, reference):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for lp, ref_lp in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert lp.keys() == ref_lp.keys()
            for tok in lp:
                assert abs(lp[tok].logprob - ref_lp[tok].logprob) < 1e-4
    assert llm.llm_engine.get_stats().num_used_blocks == 0


def test_padded_decode_with_two_kv_cache_groups(monkeypatch):
    """Sliding-window and full-attention layers (two KV-cache groups, two block tables):
    padding fills both groups' buffers; greedy tokens equal the unpadded run's."""
    from tests.engine.test_hybrid_kv import _generate, _prompts, qwen2_reference

    reference = qwen2_reference.__wrapped__()
    prompts = _prompts()[:3]  # decode batches of 3, padded to 4
    unpadded, _, _ = _generate(reference, prompts, 8, hybrid=True, kv_cache_memory=98304)
    monkeypatch.setattr("pagedllm.worker.model_runner.cuda_graph_mode", lambda *args: "pad")
    sizes = []
    run = DecodeGraphRunner.run

    def spy(self, input_ids, positions, metas):
        assert len(metas) == 2 and self.block_tables.shape[0] == 2
        sizes.append((metas[0].num_reqs, self.padded_size(metas[0].num_reqs)))
        return run(self, input_ids, positions, metas)

    monkeypatch.setattr(DecodeGraphRunner, "run", spy)
    padded, _, _ = _generate(reference, prompts, 8, hybrid=True, kv_cache_memory=98304)
    assert (3, 4) in sizes
    assert padded == unpadded


def test_captured_metadata_selects_split_kv_for_small_batches():
    """A graph is captured with max_seq_len = max_model_len, so the Triton backend bakes in its
    split-KV layout for small decode batches (any context at replay) and the unified kernel
    for large ones; the layout's launch shape then depends on the batch size only."""
    pytest.importorskip("triton")
    from pagedllm.attention.triton_paged import TritonPagedAttention

    runner = DecodeGraphRunner(lambda ids, pos: None, [1, 64], max_blocks_per_seq=256, block_size=16,
                               padding_block=0, max_model_len=4096, device=torch.device("cpu"), use_graphs=False,
                               num_groups=2)
    cache = torch.zeros(2, 1, 16, 8, 64)  # 8 KV heads
    backend = TritonPagedAttention()
    small, large = runner._metadata(1, 4096, [4096]), runner._metadata(64, 4096, [4096] * 64)
    assert len(small) == 2 and small[1].block_tables.shape == (1, 256)
    assert backend.num_splits(small[0], cache) > 1
    assert backend.num_splits(large[0], cache) == 1
