"""Hybrid KV cache end to end: a model with sliding-window layers served through the model
runner and the scheduler, out-of-window blocks freed, against transformers.

The model is transformers' Qwen2 with ``layer_types`` (layers 0, 2 sliding with window 8,
layers 1, 3 full), loaded as pagedllm's ``Qwen2ForCausalLM``, whose sliding layers honour the
window in the attention backend the runner chose; the runner reads each layer's
``sliding_window`` to build the groups.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.loader.model_files import ModelFiles
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner
from tests.model_utils import _init_

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


@pytest.fixture(scope="module")
def qwen2_reference():
    """(transformers Qwen2 with sliding layers, its weights, its config)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dims = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
    hf_config = Qwen2Config(**dims, use_sliding_window=True, sliding_window=WINDOW, layer_types=LAYER_TYPES,
                            dtype="float32")
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(hf_config).eval()
    with torch.no_grad():
        _init_(hf.named_parameters(), torch.Generator().manual_seed(0))
    hf_config.architectures = ["Qwen2ForCausalLM"]
    return hf, dict(hf.state_dict()), hf_config


def _make_runner(reference, cfg: EngineConfig) -> ModelRunner:
    """A runner over the Qwen2 weights (its sliding layers honour the window)."""
    _, weights, config = reference
    files = ModelFiles(hf_config=config, tokenizer=None, chat_template=None, eos_token_id=None, stop_token_ids=[],
                       max_model_len=128, source="test", format="hf", _weights_fn=lambda dtype: iter(weights.items()))
    return ModelRunner(cfg, files)


def _generate(reference, prompts, max_tokens, *, hybrid, kv_cache_memory=None, budget=16):
    cfg = EngineConfig(block_size=4, max_model_len=64, max_num_batched_tokens=budget, max_num_seqs=4,
                       kv_cache_memory=kv_cache_memory, disable_hybrid_kv_cache_manager=not hybrid, device="cpu",
                       dtype="float32")
    runner = _make_runner(reference, cfg)
    spec = runner.initialize_kv_cache()
    s = Scheduler(cfg, spec.num_blocks, kv_cache_groups=spec.kv_cache_groups)
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for r in reqs:
        s.add_request(r)
    while s.has_unfinished_requests():
        so = s.schedule()
        s.update_from_output(so, runner.execute_model(so))
        s.check_integrity()
    assert s.kv_cache_manager.num_used_blocks == 0
    return [r.output_token_ids for r in reqs], s, spec


def _prompts():
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 256, (24,), generator=g).tolist()
    return [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (17, 1, 9)] + \
        [torch.randint(3, 256, (5,), generator=g).tolist()]


def test_groups_and_capacity_report(qwen2_reference):
    cfg = EngineConfig(block_size=4, max_model_len=64, max_num_batched_tokens=16, num_kv_blocks=100, device="cpu")
    spec = _make_runner(qwen2_reference, cfg).initialize_kv_cache()
    assert [(g.layer_ids, g.sliding_window) for g in spec.kv_cache_groups] == [((1, 3), None), ((0, 2), WINDOW)]
    # a block is 2 layers x 4 tokens x 2 KV heads x 16 x 4 bytes, K and V
    assert spec.bytes_per_block == 2 * 2 * 4 * 2 * 16 * 4
    # 64 tokens: 16 blocks full + min(16, cdiv(7 + 16, 4) + 1 = 7) sliding
    assert spec.blocks_per_seq == 23 and spec.max_concurrency == pytest.approx(99 / 23)
    assert spec.full_attention_max_concurrency == pytest.approx(100 / 32)
    assert spec.num_tokens == 100 * 4 * 2 // 4  # a block holds half of a token's layers
    assert "hybrid: 2 KV-cache groups of 2 layers, 1 sliding-window" in spec.describe()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_equals_transformers_and_keeping_all_blocks(qwen2_reference, backend, monkeypatch):
    """The same 96 KiB pool: 48 blocks of 2 layers (hybrid) or 24 blocks of 4 layers (all
    blocks kept). Kept, the four sequences end holding 25 blocks (the shared 24-token prefix
    6, their own tails 7 + 3 + 5, the short one 4): one preemption. Hybrid, the full group
    holds those 25 and the sliding group at most 3 per decoding sequence: none. The
    tokens are the same, and transformers' greedy choices."""
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", backend)  # the runner picks the backend at construction
    hf = qwen2_reference[0]
    prompts = _prompts()
    hybrid, s, spec = _generate(qwen2_reference, prompts, 12, hybrid=True, kv_cache_memory=98304)
    kept, s_kept, spec_kept = _generate(qwen2_reference, prompts, 12, hybrid=False, kv_cache_memory=98304)
    assert (spec.num_blocks, spec_kept.num_blocks) == (48, 24)
    assert hybrid == kept
    assert (s.num_preemptions, s_kept.num_preemptions) == (0, 1)
    kv = s.kv_cache_manager
    assert kv.num_window_freed_blocks > 0 and kv.prefix_cache_hits > 0
    assert s_kept.kv_cache_manager.num_window_freed_blocks == 0
    with torch.no_grad():
        for prompt, out in zip(prompts, hybrid):
            logits = hf(torch.tensor([prompt + out])).logits[0]
            assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_families_through_the_hybrid_runner(family):
    """Gemma 3 (sliding and full layers, a rope table per layer type) and Mistral (every layer
    sliding: one sliding group) served with blocks freed: transformers' greedy tokens."""
    from tests.family_utils import family_config, make_hf_model

    hf = make_hf_model(family_config(family), seed=5)
    hf.config.architectures = [type(hf).__name__]
    prompts = _prompts()
    out, s, spec = _generate((hf, dict(hf.state_dict()), hf.config), prompts, 10, hybrid=True,
                             kv_cache_memory="4MiB")
    assert spec.is_hybrid and s.kv_cache_manager.num_window_freed_blocks > 0
    with torch.no_grad():
        for prompt, tokens in zip(prompts, out):
            logits = hf(torch.tensor([prompt + tokens])).logits[0]
            assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == tokens
