"""Mixture of experts: the block against transformers' (routing normalisations, experts no token
chose, compute only on routed tokens), checkpoint name variants, missing experts.

The whole Mixtral and Qwen3-MoE models go through every family test in
``tests/test_model_families.py`` (HF folder, paged prefill/decode/chunked/mixed, prefix hit;
Mixtral's GGUF round trip).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backend import set_forward_context
from pagedllm.loader import load_model_files
from pagedllm.models import get_model_class
from pagedllm.models.layers.moe import FusedMoE, select_experts
from tests.family_utils import family_config, make_hf_model

ATOL = 1e-4


def _hf_block(config):
    """transformers' sparse MoE block of ``config`` with seeded weights (float32, eval)."""
    if config.model_type == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    torch.manual_seed(0)
    block = Block(config).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) / p.shape[-1] ** 0.5)
    return block


def _our_block(config, hf_block):
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    block = FusedMoE(config.hidden_size, width, experts, config.num_experts_per_tok, config.hidden_act,
                     renormalize=bool(getattr(config, "norm_topk_prob", True)))
    with torch.no_grad():
        block.gate.weight.copy_(hf_block.gate.weight)
        block.experts.gate_up_proj.copy_(hf_block.experts.gate_up_proj)
        block.experts.down_proj.copy_(hf_block.experts.down_proj)
    return block


@pytest.mark.parametrize("name, overrides", [("mixtral", {}), ("qwen3_moe", {"norm_topk_prob": False}),
                                             ("qwen3_moe", {"norm_topk_prob": True})])
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_block_equals_transformers_even_with_idle_experts(name, overrides, num_tokens):
    config = family_config(name, **overrides)
    hf = _hf_block(config)
    ours = _our_block(config, hf)
    x = torch.randn(num_tokens, config.hidden_size, generator=torch.Generator().manual_seed(num_tokens))
    with torch.no_grad():
        expected = hf(x.unsqueeze(0))[0]
        got = ours(x)
        _, ids = select_experts(ours.gate(x), config.num_experts_per_tok, True)
    counts = torch.bincount(ids.reshape(-1), minlength=8)
    if num_tokens < 4:  # 8 experts, 2 per token: at least 2 experts receive no token
        assert (counts == 0).sum() >= 8 - 2 * num_tokens
    assert (got - expected).abs().max().item() < 1e-5


def test_routing_normalisations():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = select_experts(logits, 2, renormalize=True)
    assert ids.tolist() == [[0, 1]]
    assert torch.allclose(w, torch.softmax(torch.tensor([[2.0, 1.0]]), -1))  # Mixtral: softmax over the top-k
    w, _ = select_experts(logits, 2, renormalize=False)
    assert torch.allclose(w, torch.softmax(logits, -1)[:, :2])  # Qwen3-MoE without norm_topk_prob


def test_experts_compute_only_routed_tokens():
    """Matmul FLOPs are those of T x top_k expert evaluations (plus the router), not T x E."""
    from torch.utils.flop_counter import FlopCounterMode

    config = family_config("mixtral")
    block = _our_block(config, _hf_block(config))
    h, inter, num_tokens = config.hidden_size, config.intermediate_size, 5
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        block(torch.randn(num_tokens, h))
    router = 2 * num_tokens * h * 8
    routed = 2 * num_tokens * 2 * (h * 2 * inter + inter * h)
    assert counter.get_total_flops() == router + routed


@pytest.mark.parametrize("overrides", [{"norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": []}])
def test_qwen3_moe_sparse_step_and_normalised_top_k(overrides):
    hf = make_hf_model(family_config("qwen3_moe", **overrides), seed=3)
    cls = get_model_class(hf.config)
    model = cls(hf.config, torch.float32, "cpu")
    model.load_weights(hf.state_dict().items())  # transformers' own fused expert names load too
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["GatedMLP", "FusedMoE", "GatedMLP"]
    seq = torch.randint(3, 512, (24,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), set_forward_context(None):
        logits = model.compute_logits(model(seq, torch.arange(24)))
        expected = hf(seq.unsqueeze(0)).logits[0]
    assert (logits - expected).abs().max().item() < ATOL


def test_missing_expert_names_it_and_the_architecture(tmp_path, smollm2_path):
    hf = make_hf_model(family_config("mixtral"))
    hf.save_pretrained(tmp_path)
    files = load_model_files(str(tmp_path), str(smollm2_path))
    model = get_model_class(files.hf_config)(files.hf_config)
    dropped = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    weights = ((n, t) for n, t in files.weights(torch.float32) if n != dropped)
    with pytest.raises(ValueError, match=r"MixtralForCausalLM: model\.layers\.1\.mlp\.experts\.3\.w2\.weight"):
        model.load_weights(weights)
    with pytest.raises(ValueError, match="no expert weight 'w2' for expert 8"):
        model.load_weights([("model.layers.0.block_sparse_moe.experts.8.w2.weight", torch.zeros(64, 128))])


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_served_greedy_equals_transformers(name):
    """Through the model runner and the scheduler (chunked prefill, prefix hits, decodes of a
    few sequences at once): transformers' greedy tokens."""
    from tests.engine.test_hybrid_kv import _generate, _prompts

    hf = make_hf_model(family_config(name), seed=11)
    hf.config.architectures = [type(hf).__name__]
    prompts = _prompts()
    out, _, _ = _generate((hf, dict(hf.state_dict()), hf.config), prompts, 8, hybrid=True, kv_cache_memory="4MiB")
    with torch.no_grad():
        for prompt, tokens in zip(prompts, out):
            logits = hf(torch.tensor([prompt + tokens])).logits[0]
            assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == tokens
