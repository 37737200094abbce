"""Mixtral: Mistral with a :class:`~pagedllm.models.layers.moe.FusedMoE` in place of the MLP (checkpoints:
``block_sparse_moe``, ``w1`` gate, ``w3`` up, ``w2`` down)."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.models.layers.moe import FusedMoE, MoEWeightsMixin
from pagedllm.models.mistral import MistralForCausalLM


class MixtralForCausalLM(MoEWeightsMixin, MistralForCausalLM):
    """Same contract as :class:`~pagedllm.models.llama.LlamaForCausalLM` for a ``MixtralConfig``."""

    module_aliases = {"block_sparse_moe": "mlp"}
    expert_parts = ("w1", "w3", "w2")

    def _mlp(self, config: Any, layer_idx: int) -> nn.Module:
        return FusedMoE(config.hidden_size, config.intermediate_size, config.num_local_experts,
                        config.num_experts_per_tok, config.hidden_act, renormalize=True)
