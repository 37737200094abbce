"""``quantization="gguf"``: Q8_0 kept as int8 groups of 32, Q4_0/Q4_1/Q4_K as int4 groups of 32, without requantizing.

ggml's block layouts (``ggml-quants.c``):
- Q8_0 (34 bytes / 32 weights): f16 ``d``, int8 ``q[32]``; ``w = d * q``.
- Q4_0 (18 bytes): f16 ``d``, 16 bytes of nibbles (element j low, j + 16 high); ``w = d * (q - 8)``.
- Q4_1 (20 bytes): f16 ``d``, f16 ``m``, nibbles as Q4_0; ``w = d * q + m``.
- Q4_K (144 bytes / 256): f16 ``d``, f16 ``dmin``, 12 bytes of 6-bit scales/mins of 8 sub-blocks
  of 32, 128 bytes of nibbles (per 64 weights: 32 low, then 32 high); ``w = d * sc * q - dmin * m``.
Other types, and fused layers whose parts differ in type, load dequantized.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K
from torch import nn

from pagedllm.quantization.base import LinearMethod, QuantizationConfig, replace_weight
from pagedllm.quantization.int4 import Int4LinearMethod
from pagedllm.quantization.int8 import Int8LinearMethod

logger = logging.getLogger("pagedllm")

Q = GGMLQuantizationType
KEPT_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[:, offset:offset + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def convert_q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """raw (N, K / 32 * 34) uint8 -> q (N, K) int8, scales (N, K / 32) float32."""
    n = raw.shape[0]
    blocks = raw.reshape(-1, 34)
    q = blocks[:, 2:].copy().view(np.int8)
    return q.reshape(n, -1), _f16(blocks, 0).reshape(n, -1)


def convert_q4(raw: np.ndarray, kind: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw (N, row_bytes) uint8 → q (N, K) uint8, scales and zeros (N, K / 32) float32."""
    n = raw.shape[0]
    if kind == Q.Q4_0:
        blocks = raw.reshape(-1, 18)
        d = _f16(blocks, 0)
        q, scales, zeros = _nibbles_32(blocks[:, 2:]), d, np.zeros_like(d)
    elif kind == Q.Q4_1:
        blocks = raw.reshape(-1, 20)
        d, m = _f16(blocks, 0), _f16(blocks, 2)
        q, scales, zeros = _nibbles_32(blocks[:, 4:]), d, m + 8.0 * d
    elif kind == Q.Q4_K:
        blocks = raw.reshape(-1, 144)
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mins = Q4_K.get_scale_min(blocks[:, 4:16])  # (B, 8) each
        scales = d[:, None] * sc.astype(np.float32)  # exact: 11-bit mantissa x 6-bit integer
        zeros = 8.0 * scales - dmin[:, None] * mins.astype(np.float32)
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(-1, 256)  # (B, 256): per 64 weights, 32 low nibbles then 32 high
    else:
        raise ValueError(f"GGUF type {kind.name} is not a 4-bit type this converter keeps")
    return q.reshape(n, -1), scales.reshape(n, -1), zeros.reshape(n, -1)


def row_bytes(in_features: int, kind: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[kind]
    return in_features // block_size * type_size


class GGUFLinearMethod(LinearMethod):
    """The loader fills ``layer.weight`` with (N, row_bytes) uint8 blocks; then it acts as int8 or int4."""

    def __init__(self, kind: GGMLQuantizationType) -> None:
        if kind not in KEPT_TYPES:
            raise ValueError(f"GGUF type {kind.name} cannot be kept quantized (kept: "
                             f"{', '.join(k.name for k in KEPT_TYPES)})")
        self.kind = kind
        self.inner: LinearMethod = Int8LinearMethod() if kind == Q.Q8_0 else Int4LinearMethod(32)

    def create_weights(self, layer: nn.Module) -> None:
        weight = layer.weight
        layer.weight_dtype = weight.dtype
        raw = torch.empty(layer.out_features, row_bytes(layer.in_features, self.kind), dtype=torch.uint8,
                          device=weight.device)
        replace_weight(layer, raw)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        raw = layer.weight.detach().cpu().numpy()
        if self.kind == Q.Q8_0:
            q, scales = convert_q8_0(raw)
            Int8LinearMethod.set_quantized(layer, torch.from_numpy(q), torch.from_numpy(scales))
        else:
            q, scales, zeros = convert_q4(raw, self.kind)
            Int4LinearMethod.set_quantized(layer, torch.from_numpy(q), torch.from_numpy(scales),
                                           torch.from_numpy(zeros))
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(layer, x)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return self.inner.dequantize(layer)


class GGUFConfig(QuantizationConfig):
    """Keeps a layer packed when its checkpoint tensors (``fused_parts``: leaf → parts) share a kept type."""

    name = "gguf"

    def __init__(self, tensor_types: dict[str, GGMLQuantizationType], fused_parts: dict[str, list[str]]) -> None:
        self.tensor_types = tensor_types
        self.fused_parts = fused_parts
        self._packed: set[str] = set()
        self.num_kept = self.num_float = 0

    def get_linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        parent, _, leaf = prefix.rpartition(".")
        parts = [f"{parent}.{p}.weight" if parent else f"{p}.weight" for p in self.fused_parts.get(leaf, [leaf])]
        if not all(p in self.tensor_types for p in parts):  # stored fused under its own name
            parts = [f"{prefix}.weight"]
        kinds = {self.tensor_types.get(p) for p in parts}
        kind = kinds.pop() if len(kinds) == 1 else None
        if kind not in KEPT_TYPES or layer.in_features % 32:
            self.num_float += 1
            return None
        self._packed.update(parts)
        self.num_kept += 1
        return GGUFLinearMethod(kind)

    @property
    def packed_weight_names(self) -> frozenset[str]:
        return frozenset(self._packed)
