"""Qwen 3 (``Qwen3ForCausalLM``): Llama with a per-head RMSNorm on q and k before the rotation
(``q_norm``/``k_norm``), an explicit ``head_dim``, and no biases unless ``attention_bias``."""

from __future__ import annotations

from typing import Any

from pagedllm.attention import AttentionBackend
from pagedllm.models.layers import RMSNorm, SelfAttention
from pagedllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Same contract as :class:`~pagedllm.models.llama.LlamaForCausalLM` for a ``Qwen3Config``."""

    def _attention(self, config: Any, layer_idx: int, backend: AttentionBackend, **options: Any) -> SelfAttention:
        return super()._attention(config, layer_idx, backend, qk_norm=RMSNorm, qk_norm_eps=config.rms_norm_eps,
                                  **options)
