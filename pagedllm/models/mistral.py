"""Mistral and Phi-3: Llama with an optional ``sliding_window`` on every layer; Phi-3 checkpoints
store ``qkv_proj`` and ``gate_up_proj`` fused, the engine's own layout."""

from __future__ import annotations

from pagedllm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same contract as :class:`~pagedllm.models.llama.LlamaForCausalLM` for a ``MistralConfig``."""


class Phi3ForCausalLM(LlamaForCausalLM):
    """Same contract as :class:`~pagedllm.models.llama.LlamaForCausalLM` for a ``Phi3Config``."""
