"""pagedllm's Llama against transformers' LlamaForCausalLM with the same random weights.

Logits must agree (float32, max abs diff < 1e-4) for a no-cache forward, for prefill
through the paged cache, and for decode steps and chunked prefill that read earlier tokens
back from shuffled blocks, with several requests mixed in each batch.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backend import set_forward_context
from pagedllm.models import get_model_class, supported_architectures
from pagedllm.models.layers.rotary import rope_inv_freq, rope_parameters
from pagedllm.models.llama import LlamaForCausalLM
from tests.model_utils import make_llama_pair, random_llama_weights, run_paged, tiny_llama_config

ATOL = 1e-4

CONFIGS = {
    "gqa_untied": {},
    "gqa_tied": {"tie_word_embeddings": True},
    "mqa_llama3_rope": {"num_key_value_heads": 1, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    "mha_linear_rope_bias": {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True,
                             "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
}


def sequences(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@torch.no_grad()
def hf_logits(hf, seq: list[int]) -> torch.Tensor:
    return hf(torch.tensor([seq])).logits[0].float()


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    return make_llama_pair(tiny_llama_config(**CONFIGS[request.param]), seed=len(request.param))


def test_no_cache_forward_matches_transformers(pair):
    hf, model = pair
    seq = sequences(512, [40])[0]
    with torch.inference_mode(), set_forward_context(None):
        logits = model.compute_logits(model(torch.tensor(seq), torch.arange(len(seq))))
    assert logits.dtype == torch.float32 and logits.shape == (40, 512)
    assert (logits - hf_logits(hf, seq)).abs().max().item() < ATOL


@pytest.mark.parametrize("block_size,chunk_size", [(16, None), (1, None), (32, 8), (16, 5)])
def test_paged_prefill_and_decode_match_transformers(pair, block_size, chunk_size):
    """Prompts of mixed lengths, then 6-30 teacher-forced decode steps, several requests per step."""
    hf, model = pair
    prompt_lens = [1, 7, 33, 20]
    seqs = sequences(512, [7, 13, 63, 50], seed=block_size)
    out = run_paged(model, seqs, prompt_lens, block_size=block_size, chunk_size=chunk_size)
    for seq, logits in zip(seqs, out):
        diff = (logits - hf_logits(hf, seq)).abs().max().item()
        assert diff < ATOL, f"max abs diff {diff} (len {len(seq)})"


def test_greedy_decode_through_cache_matches_transformers_generate():
    hf, model = make_llama_pair(tiny_llama_config(), seed=7)
    prompt = sequences(512, [9], seed=7)[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0].tolist()
    seq = list(prompt)
    for _ in range(12):  # grow one greedy token at a time, every step re-run through a fresh paged cache
        seq.append(int(run_paged(model, [seq], [len(prompt)])[0][-1].argmax()))
    assert seq == ref


def test_bfloat16_close_to_float32():
    hf, model32 = make_llama_pair(tiny_llama_config(), seed=3)
    model16 = LlamaForCausalLM(tiny_llama_config(), torch.bfloat16, torch.device("cpu"))
    model16.load_weights(hf.state_dict().items())
    assert model16.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    seqs = sequences(512, [30, 12])
    ref = run_paged(model32, seqs, [20, 12])
    out = run_paged(model16, seqs, [20, 12])
    for a, b in zip(out, ref):
        assert a.dtype == torch.float32
        assert (a - b).abs().max().item() < 0.15 * b.abs().max().item()
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_fused_weights_are_the_hf_projections():
    hf, model = make_llama_pair(tiny_llama_config(num_key_value_heads=1), seed=1)
    layer, ref = model.model.layers[1], hf.model.layers[1]
    q, k, v = layer.self_attn.qkv_proj.weight.split([64, 16, 16])
    torch.testing.assert_close(q, ref.self_attn.q_proj.weight, atol=0, rtol=0)
    torch.testing.assert_close(k, ref.self_attn.k_proj.weight, atol=0, rtol=0)
    torch.testing.assert_close(v, ref.self_attn.v_proj.weight, atol=0, rtol=0)
    gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
    torch.testing.assert_close(gate, ref.mlp.gate_proj.weight, atol=0, rtol=0)
    torch.testing.assert_close(up, ref.mlp.up_proj.weight, atol=0, rtol=0)
    assert model.num_layers == 2 and model.num_kv_heads == 1 and model.head_dim == 16


def test_tied_embeddings_share_one_matrix():
    config = tiny_llama_config(tie_word_embeddings=True)
    model = LlamaForCausalLM(config, torch.float32, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    weights = dict(random_llama_weights(config, seed=2))
    assert "lm_head.weight" not in weights
    model.load_weights(weights.items())
    torch.testing.assert_close(model.lm_head.weight, weights["model.embed_tokens.weight"], atol=0, rtol=0)


def test_rope_parameters_both_config_styles():
    llama3 = CONFIGS["mqa_llama3_rope"]["rope_parameters"]
    config = tiny_llama_config(rope_parameters=dict(llama3))
    inv_freq, factor = rope_inv_freq(config, 16)
    base = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert factor == 1.0 and inv_freq.shape == (8,)
    torch.testing.assert_close(inv_freq[0], base[0])  # high frequencies untouched
    torch.testing.assert_close(inv_freq[-1], base[-1] / 8.0)  # lowest frequency divided by the factor

    class OldStyle:  # transformers 4.x: rope_theta + rope_scaling with a "type" key
        rope_theta = 1234.0
        rope_scaling = None

    assert rope_parameters(OldStyle()) == {"rope_theta": 1234.0, "rope_type": "default"}
    inv_freq, _ = rope_inv_freq(OldStyle(), 8)
    torch.testing.assert_close(inv_freq, 1.0 / 1234.0 ** (torch.arange(0, 8, 2).float() / 8))
    OldStyle.rope_scaling = {"type": "su", "factor": 2.0}
    with pytest.raises(ValueError, match="rope type 'su' is not supported"):
        rope_parameters(OldStyle())


def test_load_weights_errors():
    config = tiny_llama_config()
    model = LlamaForCausalLM(config, torch.float32, torch.device("cpu"))
    weights = dict(random_llama_weights(config))
    with pytest.raises(ValueError, match="unknown weight 'model.layers.2.mlp.up_proj.weight'"):
        model.load_weights([*weights.items(), ("model.layers.2.mlp.up_proj.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match=r"shape \(64, 64\), expected \(32, 64\)"):
        model.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64))])
    missing = {k: v for k, v in weights.items() if k not in ("lm_head.weight", "model.layers.1.mlp.up_proj.weight")}
    with pytest.raises(ValueError, match="missing.*lm_head.weight.*model.layers.1.mlp.up_proj.weight"):
        model.load_weights(missing.items())
    model.load_weights([*weights.items(), ("model.rotary_emb.inv_freq", torch.zeros(8))])  # ignored buffer


def test_bind_kv_caches_checks_layout():
    model = LlamaForCausalLM(tiny_llama_config(), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="one tensor per layer"):
        model.bind_kv_caches([torch.zeros(2, 4, 16, 2, 16)])
    with pytest.raises(ValueError, match=r"kv_caches\[1\]"):
        model.bind_kv_caches([torch.zeros(2, 4, 16, 2, 16), torch.zeros(2, 4, 16, 4, 16)])
    caches = [torch.zeros(2, 4, 16, 2, 16) for _ in range(2)]
    model.bind_kv_caches(caches)
    assert model.model.layers[1].self_attn.attn.kv_cache is caches[1]
    model.bind_kv_caches([])
    assert all(layer.self_attn.attn.kv_cache is None for layer in model.model.layers)


def test_registry():
    assert get_model_class(tiny_llama_config()) is LlamaForCausalLM  # by model_type
    config = tiny_llama_config()
    config.architectures = ["LlamaForCausalLM"]
    assert get_model_class(config) is LlamaForCausalLM
    config.architectures, config.model_type = ["FalconForCausalLM"], "falcon"
    with pytest.raises(ValueError, match="unsupported model architecture.*Falcon.*supported: .*LlamaForCausalLM"):
        get_model_class(config)
    assert "LlamaForCausalLM" in supported_architectures()


def test_cpu_prepacked_linears_follow_reloads_and_can_be_disabled(monkeypatch):
    """load_weights prepacks projections for oneDNN on CPU; reloading repacks; the env switch
    keeps the plain F.linear path. Every variant matches transformers."""
    from pagedllm.models.layers.linear import Linear

    config = tiny_llama_config()
    hf, model = make_llama_pair(config, seed=11)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    expect_packed = torch.backends.mkldnn.is_available()
    assert all(m.is_packed == expect_packed for m in linears)
    seq = sequences(512, [24], seed=11)[0]
    assert (run_paged(model, [seq], [16])[0] - hf_logits(hf, seq)).abs().max().item() < ATOL
    hf2, _ = make_llama_pair(config, seed=12)
    model.load_weights(hf2.state_dict().items())  # new weights must reach the packed copies
    assert (run_paged(model, [seq], [16])[0] - hf_logits(hf2, seq)).abs().max().item() < ATOL
    monkeypatch.setenv("PAGEDLLM_CPU_PACKED_LINEAR", "0")
    model.load_weights(hf.state_dict().items())
    assert not any(m.is_packed for m in linears)
    assert (run_paged(model, [seq], [16])[0] - hf_logits(hf, seq)).abs().max().item() < ATOL


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_linear_bf16_math_is_opt_in_and_rounds_like_bfloat16():
    """Linear's opt-in bfloat16 math for float32: from BF16_MATH_MIN_ROWS rows it equals the
    matmul of bfloat16-rounded x and weight (float32 accumulation), below that and by default
    float32 math; torch's process-wide setting is left as it was."""
    from pagedllm.models.layers.linear import BF16_MATH_MIN_ROWS, Linear, bf16_math_supported

    g = torch.Generator().manual_seed(3)
    lin = Linear(96, 80, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 96, generator=g))
        lin.bias.copy_(torch.randn(80, generator=g))
    x = torch.randn(BF16_MATH_MIN_ROWS + 5, 96, generator=g)
    exact = torch.nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double()).float()
    rounded = torch.nn.functional.linear(x.bfloat16().double(), lin.weight.bfloat16().double(),
                                         lin.bias.double()).float()
    few = x[:BF16_MATH_MIN_ROWS - 1].contiguous()
    assert lin.pack_for_cpu(64) and not lin.bf16_math
    fp32, fp32_few = lin(x), lin(few)
    assert (fp32 - exact).abs().max() < 1e-4
    assert lin.pack_for_cpu(64, bf16_math=True) and lin.bf16_math == bf16_math_supported()
    before = torch.backends.mkldnn.matmul.fp32_precision
    bf16 = lin(x)
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    if lin.bf16_math:
        assert (bf16 - rounded).abs().max() < 1e-4 < (bf16 - exact).abs().max()  # rounded inputs, float32 sums
    else:  # no AMX: refused, float32 math
        assert (bf16 - exact).abs().max() < 1e-4
    # too few rows: float32 math (oneDNN's packed weight here, the skinny kernel without bf16_math)
    exact_few = exact[:BF16_MATH_MIN_ROWS - 1]
    assert (lin(few) - exact_few).abs().max() < 1e-4 and (fp32_few - exact_few).abs().max() < 1e-4
    lin.unpack()
    assert not lin.bf16_math


def test_fp32_matmul_env_switch(monkeypatch):
    """PAGEDLLM_CPU_FP32_MATMUL=bf16 turns bf16_math on for every packed linear of a float32
    model (logits stay near transformers'), a bad value names the variable."""
    from pagedllm.models.layers.linear import Linear, bf16_math_supported

    config = tiny_llama_config()
    monkeypatch.setenv("PAGEDLLM_CPU_FP32_MATMUL", "bf16")
    hf, model = make_llama_pair(config, seed=11)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    is_on = torch.backends.mkldnn.is_available() and bf16_math_supported()  # AMX only
    assert all(m.bf16_math == is_on for m in linears)
    seq = sequences(512, [24], seed=11)[0]
    diff = (run_paged(model, [seq], [16])[0] - hf_logits(hf, seq)).abs().max().item()
    # bfloat16 rounding, no more; float32's agreement where the opt-in is refused
    assert (ATOL if is_on else -1.0) < diff < (0.05 * hf_logits(hf, seq).abs().max().item() if is_on else ATOL), diff
    monkeypatch.setenv("PAGEDLLM_CPU_FP32_MATMUL", "fp16")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_FP32_MATMUL"):
        model.load_weights(hf.state_dict().items())
