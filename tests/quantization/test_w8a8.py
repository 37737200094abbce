"""``quantization="w8a8"``: int8 weights per channel, int8 activations per group of features (or per token),
int32 sums per group, float rescales.

Each linear equals the torch formula of :mod:`pagedllm.quantization.w8a8` bit for bit (the C kernel for every
row count, the torch formula without it), so a row's output does not depend on the rows it is batched with;
whole models: greedy agreement with float32 and batch invariance of tokens and logprobs.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.ops import int8_gemm
from pagedllm.quantization import get_quantization_config
from pagedllm.quantization.int8 import Int8LinearMethod
from pagedllm.quantization.w8a8 import ACTIVATION_GROUP, W8A8LinearMethod, quantize_activations, w8a8_matmul


def _layer(out_features=150, in_features=200, bias=True, dtype=torch.float32, seed=0, group=ACTIVATION_GROUP):
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias).to(dtype).requires_grad_(False)
    method = W8A8LinearMethod(group)
    method.create_weights(layer)
    method.process_weights_after_loading(layer)
    layer.quant_method = method
    return layer, method


def _formula(layer, x, group=ACTIVATION_GROUP):
    q = layer.qweight if "qweight" in layer._buffers else int8_gemm.unpack(layer.int8_weight)
    return w8a8_matmul(x.float(), q, layer.scales, layer.bias, group)


def test_weights_are_per_channel_int8_within_half_a_step():
    torch.manual_seed(0)
    w = nn.Linear(200, 150).weight.detach().clone()
    layer, method = _layer()
    q = int8_gemm.unpack(layer.int8_weight) if "qweight" not in layer._buffers else layer.qweight
    assert q.dtype == torch.int8 and q.shape == (150, 200)
    assert "weight" not in layer._parameters and layer.scales.shape == (150,)
    assert ((method.dequantize(layer) - w).abs() <= layer.scales.unsqueeze(1) / 2 + 1e-7).all()


@pytest.mark.parametrize("group", [ACTIVATION_GROUP, None])
def test_the_kernel_gives_the_formula_and_a_row_the_same_bits_in_any_batch(group):
    """Prefill-sized and decode-sized calls alike; the first rows' outputs never change; without the C kernel the
    torch formula runs (the same bits)."""
    layer, method = _layer(group=group)
    x = torch.randn(300, 200) * 2
    ref = _formula(layer, x, group)
    for rows in (1, 2, 7, 64, 65, 300):
        assert torch.equal(method.apply(layer, x[:rows]), ref[:rows]), rows
    if layer.int8_weight is not None:
        layer.register_buffer("qweight", int8_gemm.unpack(layer.int8_weight))
        layer.int8_weight = None
    assert torch.equal(method.apply(layer, x[:3]), ref[:3])


def test_the_kernel_keeps_only_its_panels():
    """No (K, N) copy beside the panels: one byte per weight, the outputs padded to panels of 64."""
    if int8_gemm.load_kernel() is None:
        pytest.skip("no C compiler for the int8 GEMM kernel")
    layer, method = _layer()
    assert "qweight" not in layer._buffers and layer.int8_weight.activation_group == ACTIVATION_GROUP
    assert layer.kernel_panels.nbytes == 192 * 200


def test_formula_is_dequantize_then_matmul_in_float64():
    layer, method = _layer(bias=False)
    x = torch.randn(5, 200)
    xq, sx = quantize_activations(x, ACTIVATION_GROUP)
    dx = xq.double() * sx.double().repeat_interleave(ACTIVATION_GROUP, dim=1)[:, :200]
    ref = dx @ method.dequantize(layer).double().T
    got = method.apply(layer, x).double()
    assert (got - ref).abs().max() <= 8 * torch.finfo(torch.float32).eps * ref.abs().max()


def test_an_activation_group_must_be_a_multiple_of_4():
    with pytest.raises(ValueError, match="activation_group"):
        W8A8LinearMethod(30)


def test_bfloat16_activations_round_the_float32_result_once():
    layer, method = _layer(dtype=torch.bfloat16)
    x = torch.randn(6, 200).to(torch.bfloat16)
    got = method.apply(layer, x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, _formula(layer, x).to(torch.bfloat16))


def test_group_scales_are_refused():
    layer = nn.Linear(64, 8).requires_grad_(False)
    with pytest.raises(ValueError, match="w8a8"):
        W8A8LinearMethod.set_quantized(layer, torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2))


def test_config_name():
    assert get_quantization_config("w8a8").name == "w8a8"


# -- whole models --------------------------------------------------------------------------------

def _llm(model_dir, **kw):
    return LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64, **kw)


def test_tiny_model_greedy_agreement_and_batch_invariance(tiny_model_dir):
    """Greedy tokens agree with float32 (measured 0.99 on these 8 x 16 tokens; floor 0.9); a request alone
    and in a batch of 8 gives identical tokens and logprobs (prefill, decode and mixed steps); the int8 copies
    take less than the float32 weights."""
    from tests.engine.test_engine_equivalence import _prompts, _tokens

    prompts = _prompts(8, seed=5, lo=5, hi=40)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    llm_f = _llm(tiny_model_dir)
    ref = _tokens(llm_f.generate(prompts, greedy, use_tqdm=False))
    llm_q = _llm(tiny_model_dir, quantization="w8a8")
    batched = llm_q.generate(prompts, greedy, use_tqdm=False)
    got = _tokens(batched)
    agree = sum(a == b for x, y in zip(got, ref) for a, b in zip(x, y)) / sum(map(len, ref))
    assert agree >= 0.9
    for i in (0, 5):
        alone = llm_q.generate([prompts[i]], greedy, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == batched[i].outputs[0].token_ids
        assert [{t: p.logprob for t, p in d.items()} for d in alone.logprobs] == \
            [{t: p.logprob for t, p in d.items()} for d in batched[i].outputs[0].logprobs]
    model_q, model_f = llm_q.llm_engine.runner.model, llm_f.llm_engine.runner.model
    kept = [m for m in model_q.modules() if isinstance(getattr(m, "quant_method", None), W8A8LinearMethod)]
    assert len(kept) == 2 * 4 + 1  # qkv, o, gate_up, down per layer and the tied LM head
    assert model_q.model.embed_tokens.weight.dtype == torch.float32  # the embedding keeps its float rows
    dense = dict(model_f.named_modules())
    for name, m in model_q.named_modules():
        if name != "lm_head" and m in kept:  # its int8 copies: about half the float32 bytes
            panels = getattr(m, "kernel_panels", None)
            held = sum(t.nbytes for t in m.buffers(recurse=False)) + (0 if panels is None else panels.nbytes)
            assert held < 0.3 * dense[name].weight.nbytes, name


def test_decode_graphs_replay_the_eager_tokens_and_logprobs(tiny_model_dir):
    """The decode rows' kernel calls are recorded into CPU decode graphs: replays give the eager run's bits."""
    from tests.engine.test_engine_equivalence import _prompts

    if int8_gemm.load_kernel() is None:
        pytest.skip("no C compiler for the int8 GEMM kernel")
    prompts = _prompts(3, seed=7, lo=5, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    llm = _llm(tiny_model_dir, quantization="w8a8")
    graphs = llm.llm_engine.runner.cpu_graphs
    got = llm.generate(prompts, params, use_tqdm=False)
    assert graphs is not None and graphs.num_replayed > 0 and not graphs.refused
    eager = _llm(tiny_model_dir, quantization="w8a8", enforce_eager=True).generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: p.logprob for t, p in d.items()} for d in a.outputs[0].logprobs] == \
            [{t: p.logprob for t, p in d.items()} for d in b.outputs[0].logprobs]


# -- the real default model (slow) ---------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_w8a8_greedy_agreement(smollm2_path):
    """Greedy agreement with float32 over 16 chat prompts x 64 tokens (share before the first divergence).
    The floor sits below the figure measured with activation groups of 64, above the per-token one
    (benchmarks/results/w8a8_activation_groups*.json) and above a broken kernel (a wrong scale or layout diverges
    at the first token: 0). The tiny-model tests pin the numerics exactly."""
    from tests.quantization.test_quantization import _prefix_agreement, _smollm2_greedy

    _, ref = _smollm2_greedy(smollm2_path)
    _, got = _smollm2_greedy(smollm2_path, quantization="w8a8")
    assert _prefix_agreement(ref, got) >= W8A8_GREEDY_FLOOR


W8A8_GREEDY_FLOOR = 0.15


@pytest.mark.slow
def test_smollm2_w8a8_perplexity_within_2_percent_of_float32(smollm2_path):
    """Perplexity of the Apache License text (benchmarks/data/apache-2.0.txt) from the engine's prompt logprobs:
    W8A8 within +2% of float32 (issue #39's bound; per-token activation scales miss it, docs/quantization.md)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "apache-2.0.txt").read_text()
    ppl = {}
    for quantization in (None, "w8a8"):
        llm = LLM(model=str(smollm2_path), max_model_len=2560, kv_cache_memory="256MiB", quantization=quantization)
        ids = llm.get_tokenizer()(text)["input_ids"]
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        nll = [-entry[tok].logprob for tok, entry in zip(ids[1:], out.prompt_logprobs[1:])]
        ppl[quantization] = math.exp(sum(nll) / len(nll))
        del llm
    assert ppl["w8a8"] <= 1.02 * ppl[None], ppl


@pytest.mark.parametrize("in_features,group,straddles", [(128, 64, False), (96, 64, True), (128, None, True)])
def test_a_row_parallel_shard_runs_the_kernel_when_it_holds_whole_groups(monkeypatch, in_features, group, straddles):
    """Under TP=2 a row-parallel shard of whole activation groups needs no other rank's maxima (the C kernel); one
    whose slice cuts a group, or per-token scales, keeps q for the torch formula's all-reduced maxima."""
    if int8_gemm.load_kernel() is None:
        pytest.skip("no C compiler for the int8 GEMM kernel")
    from pagedllm.quantization import w8a8

    monkeypatch.setattr(w8a8, "get_tensor_parallel_size", lambda: 2)
    layer = nn.Linear(in_features, 40, bias=False).requires_grad_(False)
    layer.input_is_parallel = True
    method = W8A8LinearMethod(group)
    method.process_weights_after_loading(layer)
    assert (layer.int8_weight is None) == straddles and ("qweight" in layer._buffers) == straddles
