"""The real default model (SmolLM2-135M-Instruct, its GGUF dequantized) with a random rank-8 adapter on
every projection: the engine's greedy tokens and logprobs equal PEFT's on the same weights, in one
batch with a base-model request."""

from __future__ import annotations

import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.lora.lora_utils import peft_logprobs, write_random_adapter

pytestmark = pytest.mark.slow


def _hf_model(path):
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.loader import load_model_files

    files = load_model_files(str(path))
    model = AutoModelForCausalLM.from_config(files.hf_config, dtype=torch.float32)
    model.load_state_dict(dict(files.weights(torch.float32)), strict=False)
    model.tie_weights()
    return model.eval()


def test_smollm2_adapter_equals_peft(smollm2_path, tmp_path):
    base = _hf_model(smollm2_path)
    adapter = write_random_adapter(base, tmp_path / "a", seed=7, r=8, alpha=16)
    llm = LLM(model=str(smollm2_path), enable_lora=True, max_lora_rank=8, max_model_len=256, num_kv_blocks=64)
    prompts = [[1, 504, 3458, 314, 4195, 282, 4649, 314], [1, 504, 3458, 314, 4195, 282, 4649, 314]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=4, logprobs=0), use_tqdm=False,
                        lora_request=[LoRARequest("a", 1, str(adapter)), None])
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the adapter changes the answer
    for prompt, path, out in zip(prompts, [adapter, None], outs):
        completion = out.outputs[0]
        ref = peft_logprobs(base, path, prompt + list(completion.token_ids))
        for j, token in enumerate(completion.token_ids):
            assert token == int(ref[len(prompt) - 1 + j].argmax())
            assert abs(completion.logprobs[j][token].logprob - ref[len(prompt) - 1 + j, token].item()) < 1e-3
