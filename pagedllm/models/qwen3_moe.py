"""Qwen3-MoE: layer i's MLP is a FusedMoE when i is not in ``mlp_only_layers`` and ``(i + 1) %
decoder_sparse_step == 0``, else dense (transformers' ``Qwen3MoeDecoderLayer``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.models.layers.moe import FusedMoE, MoEWeightsMixin
from pagedllm.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(MoEWeightsMixin, Qwen3ForCausalLM):
    """Same contract as :class:`~pagedllm.models.llama.LlamaForCausalLM` for a ``Qwen3MoeConfig``."""

    def _mlp(self, config: Any, layer_idx: int) -> nn.Module:
        is_sparse = (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
                     and (layer_idx + 1) % config.decoder_sparse_step == 0)
        if not is_sparse:
            return super()._mlp(config, layer_idx)
        return FusedMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                        config.num_experts_per_tok, config.hidden_act, renormalize=bool(config.norm_topk_prob))
