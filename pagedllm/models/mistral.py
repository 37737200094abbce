"""Mistral (``MistralForCausalLM``) and Phi-3 (``Phi3ForCausalLM``): Llama as far as the
engine is concerned.

- Mistral: an optional ``sliding_window`` applied on every layer (read by
  :func:`~pagedllm.models.layer_types.sliding_windows`), otherwise Llama.
- Phi-3: its checkpoints store q/k/v fused as ``qkv_proj`` and gate/up as ``gate_up_proj``,
  the engine's own fused layout, so they load as they are; ``partial_rotary_factor`` and an
  optional ``sliding_window`` come from the config. ``longrope`` scaling (the 128k variants)
  is refused by the rotary layer.
"""

from __future__ import annotations

from pagedllm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same contract as :class:`~pagedllm.models.llama.LlamaForCausalLM` for a ``MistralConfig``."""


class Phi3ForCausalLM(LlamaForCausalLM):
    """Same contract as :class:`~pagedllm.models.llama.LlamaForCausalLM` for a ``Phi3Config``."""
