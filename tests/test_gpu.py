"""Checks that need a CUDA device (skipped elsewhere): the Triton backend inside a model, CUDA-graph
replay, and the engine on CUDA against the engine on CPU. ``scripts/gpu_check.sh`` runs them."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backend import set_forward_context

pytestmark = pytest.mark.gpu


def _tiny_pair(backend=None):
    from pagedllm.models.llama import LlamaForCausalLM
    from tests.model_utils import make_hf_llama, tiny_llama_config

    config = tiny_llama_config()
    hf = make_hf_llama(config, seed=3).cuda()
    model = LlamaForCausalLM(config, torch.float32, "cuda", attn_backend=backend)
    model.load_weights(hf.state_dict().items())
    return hf, model.eval()


def test_llama_on_triton_backend_matches_transformers_on_cuda():
    from pagedllm.attention.triton_paged import TritonPagedAttention
    from tests.model_utils import run_paged

    hf, model = _tiny_pair(TritonPagedAttention())
    seqs = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 40, 90)]
    out = run_paged(model, seqs, [5, 33, 64], block_size=16, chunk_size=16)
    for seq, logits in zip(seqs, out):
        with torch.no_grad():
            expected = hf(torch.tensor([seq], device="cuda")).logits[0]
        assert (logits - expected).abs().max().item() < 1e-3


def test_cuda_graph_replay_equals_eager():
    """Two different decode steps replayed through one captured graph equal eager forwards."""
    from pagedllm.attention.triton_paged import TritonPagedAttention
    from pagedllm.worker.cuda_graph import DecodeGraphRunner
    from tests.model_utils import allocate_block_tables, make_metadata

    _, model = _tiny_pair(TritonPagedAttention())
    block_size = 16
    tables, num_blocks = allocate_block_tables([70, 9, 33], block_size, seed=1)
    shape = (2, num_blocks + 1, block_size, model.num_kv_heads, model.head_dim)
    caches = [torch.randn(shape, device="cuda") for _ in range(model.num_layers)]
    model.bind_kv_caches(caches)
    runner = DecodeGraphRunner(model, [1, 2, 4], max_blocks_per_seq=8, block_size=block_size,
                               padding_block=num_blocks, max_model_len=128, device=torch.device("cuda"),
                               use_graphs=True)
    assert runner.capture() >= 0 and set(runner.graphs) == {1, 2, 4}
    for contexts in ([60, 3, 20], [68, 7]):
        n = len(contexts)
        meta = make_metadata(contexts, [1] * n, tables[:n], block_size, "cuda")
        ids = torch.randint(0, 512, (n,), device="cuda")
        pos = torch.tensor(contexts, device="cuda")
        with torch.inference_mode():
            replayed = runner.run(ids, pos, [meta]).clone()
            with set_forward_context(meta):
                eager = model(ids, pos)
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=0)


def test_engine_on_cuda_greedy_equals_cpu(random_model_dir):
    from pagedllm import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (4, 50, 130, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for name, kw in {"cpu": dict(device="cpu"), "cuda_graphs": dict(device="cuda", dtype="float32"),
                     "cuda_eager": dict(device="cuda", dtype="float32", enforce_eager=True)}.items():
        llm = LLM(model=str(random_model_dir), max_model_len=512, **kw)
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if name == "cuda_graphs":
            assert llm.llm_engine.runner.decode_graphs is not None and llm.llm_engine.runner.decode_graphs.graphs
        del llm
    assert tokens["cuda_graphs"] == tokens["cuda_eager"] == tokens["cpu"]
