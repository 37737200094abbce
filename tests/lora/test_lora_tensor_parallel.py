"""LoRA under tensor parallelism (2 ranks, gloo): A and B sharded as their base layer (column-parallel q/k/v
and gate/up keep their rows of B, row-parallel o/down their columns of A); a mixed batch equals PEFT."""

from __future__ import annotations

import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.lora.lora_utils import write_base_folder, write_random_adapter
from tests.lora.test_lora_engine import PROMPTS, _check_against_peft

pytestmark = pytest.mark.slow


def test_tensor_parallel_mixed_batch_equals_peft(tmp_path):
    base, folder = write_base_folder("llama", tmp_path / "base")
    a1 = write_random_adapter(base, tmp_path / "a1", seed=1, r=8)
    a2 = write_random_adapter(base, tmp_path / "a2", seed=2, r=4, targets=["q_proj", "o_proj", "down_proj"])
    llm = LLM(str(folder), tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
              max_model_len=64, num_kv_blocks=64, block_size=4, worker_timeout_s=120)
    try:
        loras = [LoRARequest("a1", 1, str(a1)), None, LoRARequest("a2", 2, str(a2)), LoRARequest("a1", 1, str(a1))]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=5, logprobs=0), use_tqdm=False, lora_request=loras)
        _check_against_peft(base, outs, PROMPTS, [a1, None, a2, a1])
    finally:
        llm.llm_engine.shutdown()
