"""Qwen 2 / 2.5: Llama with q/k/v biases and sliding windows where ``layer_types`` says."""

from __future__ import annotations

from typing import Any

from pagedllm.attention import AttentionBackend
from pagedllm.models.layers import SelfAttention
from pagedllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same contract as :class:`~pagedllm.models.llama.LlamaForCausalLM` for a ``Qwen2Config``."""

    def _attention(self, config: Any, layer_idx: int, backend: AttentionBackend, **options: Any) -> SelfAttention:
        return super()._attention(config, layer_idx, backend, qkv_bias=True, o_bias=False, **options)
