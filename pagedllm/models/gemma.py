"""Gemma 2 and Gemma 3 text: Llama with scaled embeddings, four ``(1 + w)`` float32 RMSNorms per layer, GeGLU,
scale ``query_pre_attn_scalar ** -0.5``, interleaved sliding-window layers; Gemma 2: soft caps; Gemma 3:
q/k norms and per-layer-type rotary tables (transformers' modeling files)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention import AttentionBackend
from pagedllm.models.layers import GemmaRMSNorm, SelfAttention
from pagedllm.models.llama import LlamaForCausalLM


class GemmaDecoderLayer(nn.Module):
    """``x + post_attn_norm(attn(input_norm(x)))``, then ``+ post_ff_norm(mlp(pre_ff_norm(x)))``."""

    def __init__(self, self_attn: SelfAttention, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)

    def forward(self, hidden: torch.Tensor, residual: None, cos_sin: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, None]:
        """hidden: (T, hidden) -> (T, hidden), updated in place on CPU; no residual is carried between layers."""
        attn = self.self_attn(self.input_layernorm(hidden), cos_sin[self.self_attn.rope_key])
        mlp_in, hidden = self.post_attention_layernorm.add_normed(attn, hidden, self.pre_feedforward_layernorm)
        _, hidden = self.post_feedforward_layernorm.add_normed(self.mlp(mlp_in), hidden)
        return hidden, None


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Same contract as :class:`~pagedllm.models.llama.LlamaForCausalLM` for a ``Gemma2Config``."""

    norm_class = GemmaRMSNorm
    has_qk_norm = False

    def _decoder_layer(self, config: Any, layer_idx: int, backend: AttentionBackend) -> nn.Module:
        return GemmaDecoderLayer(self._attention(config, layer_idx, backend), self._mlp(config, layer_idx),
                                 config.hidden_size, config.rms_norm_eps)

    def _attention(self, config: Any, layer_idx: int, backend: AttentionBackend, **options: Any) -> SelfAttention:
        if self.has_qk_norm:
            options.update(qk_norm=GemmaRMSNorm, qk_norm_eps=config.rms_norm_eps)
        return super()._attention(config, layer_idx, backend, scale=config.query_pre_attn_scalar**-0.5,
                                  logit_soft_cap=getattr(config, "attn_logit_softcapping", None), **options)

    def _embedding_scale(self, config: Any) -> float | None:
        return config.hidden_size**0.5

    def _final_logit_soft_cap(self, config: Any) -> float | None:
        return getattr(config, "final_logit_softcapping", None)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Same contract as :class:`~pagedllm.models.llama.LlamaForCausalLM` for a ``Gemma3TextConfig`` (text only)."""

    has_qk_norm = True
