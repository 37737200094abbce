"""Model registry: Hugging Face architecture name -> ``"module:Class"``, imported on first use."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagedllm.models.mistral:MistralForCausalLM",
    "Phi3ForCausalLM": "pagedllm.models.mistral:Phi3ForCausalLM",
    "Qwen2ForCausalLM": "pagedllm.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pagedllm.models.qwen3:Qwen3ForCausalLM",
    "Gemma2ForCausalLM": "pagedllm.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "pagedllm.models.gemma:Gemma3ForCausalLM",
    "MixtralForCausalLM": "pagedllm.models.mixtral:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "pagedllm.models.qwen3_moe:Qwen3MoeForCausalLM",
    "BertModel": "pagedllm.models.bert:BertModel",
    "BertForSequenceClassification": "pagedllm.models.bert:BertForSequenceClassification",
}
# config.model_type -> architecture, for configs without ``architectures`` (e.g. built from GGUF metadata)
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "bert": "BertModel",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The model class for ``hf_config.architectures[0]`` (else ``model_type``). Raises ValueError naming the
    architecture and listing the supported ones."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    arch = architectures[0] if architectures else _MODEL_TYPES.get(model_type)
    if arch in _ARCHITECTURES:
        module_name, class_name = _ARCHITECTURES[arch].split(":")
        return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(f"unsupported model architecture {architectures or model_type!r}; "
                     f"supported: {', '.join(supported_architectures())}")
