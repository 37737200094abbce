"""The decode plan (pagedllm/attention/decode_plan.py): a decode-only step's attention kernel call
prepared once for all layers gives bitwise the logits of every layer making the call from scratch,
through steps that mix prefills and decodes, batches whose requests change from step to step, and
KV-cache formats other than the model's dtype."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import CpuPagedAttention
from pagedllm.models.llama import LlamaForCausalLM
from tests.model_utils import make_hf_llama, run_paged, tiny_llama_config

# prompt lengths 5..20 with 3..12 decode tokens each: the first steps mix prefills and decodes,
# later ones are decode-only, and requests leave the batch one after another
SEQUENCES = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([17, 9, 30, 14, 22])]
PROMPT_LENS = [5, 6, 20, 2, 10]


@pytest.fixture(scope="module")
def kernel():
    backend = CpuPagedAttention()
    if not backend.is_kernel_available:
        pytest.skip("the CPU paged-attention kernel did not build here")
    return backend.kernel


def counted_calls(kernel, monkeypatch) -> list[int]:
    """Wrap the kernel's one-struct decode functions; returns [number of calls so far]."""
    calls = [0]
    for dtype, fn in list(kernel.call_fns.items()):
        def counting(*args, fn=fn):
            calls[0] += 1
            return fn(*args)
        monkeypatch.setitem(kernel.call_fns, dtype, counting)
    return calls


@pytest.mark.parametrize("dtype, kv_dtype, planned", [
    (torch.float32, None, True), (torch.bfloat16, None, True),
    (torch.float32, torch.bfloat16, True),  # the kernel rounds new float32 K/V to the bfloat16 cache
    (torch.bfloat16, torch.float8_e4m3fn, False),  # not planned: every layer's call as before
])
def test_planned_decode_is_bitwise_the_unplanned(kernel, monkeypatch, dtype, kv_dtype, planned):
    config = tiny_llama_config(num_hidden_layers=3, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    weights = make_hf_llama(config, seed=3).state_dict()
    logits = {}
    for plan_decodes in (False, True):
        model = LlamaForCausalLM(config, dtype, attn_backend=CpuPagedAttention(kernel=kernel,
                                                                               plan_decodes=plan_decodes))
        model.load_weights(weights.items())
        calls = counted_calls(kernel, monkeypatch)
        logits[plan_decodes] = run_paged(model.eval(), SEQUENCES, PROMPT_LENS, block_size=4, kv_dtype=kv_dtype)
        # decode-only steps: one call per layer through the plan (none when it is off or does not apply)
        assert (calls[0] > 0) == (plan_decodes and planned)
        if plan_decodes and planned:
            assert calls[0] % config.num_hidden_layers == 0
    for unplanned, planned_logits in zip(logits[False], logits[True]):
        assert torch.equal(unplanned, planned_logits)


def test_layer_that_does_not_match_the_plan_is_run_from_scratch(kernel, monkeypatch):
    """A layer with other options than the plan's (here a sliding window on every other layer, all in
    one KV-cache group) is computed by the full path, and the results stay bitwise the same."""
    config = tiny_llama_config(num_hidden_layers=4, hidden_size=128)
    weights = make_hf_llama(config, seed=4).state_dict()
    logits = {}
    for plan_decodes in (False, True):
        model = LlamaForCausalLM(config, torch.float32, attn_backend=CpuPagedAttention(kernel=kernel,
                                                                                      plan_decodes=plan_decodes))
        model.load_weights(weights.items())
        for layer in model.model.layers[1::2]:
            attn = layer.self_attn.attn
            attn.impl = attn.backend.make_impl(attn.impl.scale, 6, attn.logit_soft_cap)
        logits[plan_decodes] = run_paged(model.eval(), SEQUENCES, PROMPT_LENS, block_size=4)
    for unplanned, planned_logits in zip(logits[False], logits[True]):
        assert torch.equal(unplanned, planned_logits)
