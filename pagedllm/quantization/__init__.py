"""Weight formats kept at run time (int8, W8A8, int4, GGUF blocks, pre-quantized checkpoints; one module each) and KV-cache dtypes."""

from __future__ import annotations

from pagedllm.config import QUANTIZATION_METHODS
from pagedllm.quantization.base import (LinearMethod, QuantizationConfig, create_quantized_weights,
                                        process_quantized_weights, weight_bytes)

__all__ = ["LinearMethod", "QUANTIZATION_METHODS", "QuantizationConfig", "create_quantized_weights",
           "get_prequantized_config", "get_quantization_config", "process_quantized_weights", "weight_bytes"]


def get_quantization_config(name: str, group_size: int | None = None, gguf_tensor_types: dict | None = None,
                            fused_parts: dict[str, list[str]] | None = None) -> QuantizationConfig:
    """The config for ``quantization=name``. Raises ValueError naming the bad field."""
    if name == "int8":
        from pagedllm.quantization.int8 import Int8Config
        return Int8Config()
    if name == "w8a8":
        from pagedllm.quantization.w8a8 import W8A8Config
        return W8A8Config()
    if name == "int4":
        from pagedllm.quantization.int4 import Int4Config
        return Int4Config(group_size, gguf_tensor_types, fused_parts)
    if name == "gguf":
        if gguf_tensor_types is None:
            raise ValueError("quantization='gguf' needs a .gguf model file; use 'int8' or 'int4' for other models")
        from pagedllm.quantization.gguf import GGUFConfig
        return GGUFConfig(gguf_tensor_types, fused_parts or {})
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None), got {name!r}")


def get_prequantized_config(quantization, fused_parts: dict[str, list[str]]) -> QuantizationConfig:
    """The config for a checkpoint's ``quantization_config`` (a parsed ``CheckpointQuantization``)."""
    from pagedllm.quantization.prequantized import PrequantizedConfig

    return PrequantizedConfig(quantization, fused_parts)
