"""compressed-tensors checkpoints (llm-compressor's format) → pagedllm's int8 / int4 values, exactly.

Per projection: ``weight_scale`` (N, G) (or (N, 1) per channel, (1,) per tensor), and
- ``int-quantized`` / ``naive-quantized``: ``weight`` (N, K) int8 holding the signed values;
- ``pack-quantized``: ``weight_packed`` (N, K * bits / 32) int32, the values plus ``2 ** (bits - 1)``
  packed along K (:mod:`pagedllm.quantization.packed_ints`);
- with zero points: ``weight_zero_point`` (N, G) int8, or packed like the weight along N,
  (N * bits / 32, G), in ``pack-quantized``.
The weight is ``w = (q - zero_point) * scale`` (q, zero_point signed), per compressed-tensors'
``dequantize``. ``weight_shape`` is checked; ``weight_g_idx`` must be the identity order.
"""

from __future__ import annotations

import torch

from pagedllm.loader.quantization_config import WeightScheme
from pagedllm.quantization.packed_ints import unpack_int32

SUFFIXES = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
OPTIONAL_SUFFIXES = ("weight_shape", "weight_g_idx")


def required_suffixes(scheme: WeightScheme) -> tuple[str, ...]:
    values = "weight_packed" if scheme.format == "pack-quantized" else "weight"
    return (values, "weight_scale") + (() if scheme.symmetric else ("weight_zero_point",))


def signed_values(tensors: dict[str, torch.Tensor], scheme: WeightScheme) -> torch.Tensor:
    """q (N, K) int32, signed (``[-2 ** (bits - 1), 2 ** (bits - 1))``)."""
    offset = 1 << (scheme.bits - 1)
    if scheme.format == "pack-quantized":
        return unpack_int32(tensors["weight_packed"], scheme.bits, dim=1) - offset
    weight = tensors["weight"]
    if weight.dtype != torch.int8:
        raise ValueError(f"a {scheme.format} weight must be int8, got {weight.dtype}")
    return weight.to(torch.int32)


def scales_and_zero_points(tensors: dict[str, torch.Tensor], scheme: WeightScheme, num_rows: int
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """scale (N, G) float32 (a per-tensor scale repeated per row) and zero point (N, G) int32 or None."""
    scale = tensors["weight_scale"].float()
    scale = scale.reshape(1, 1).expand(num_rows, 1) if scale.numel() == 1 else scale.reshape(num_rows, -1)
    if scheme.symmetric:
        return scale.contiguous(), None
    zero = tensors["weight_zero_point"]
    if scheme.format == "pack-quantized":
        zero = unpack_int32(zero, scheme.bits, dim=0)[:num_rows] - (1 << (scheme.bits - 1))
    zero = zero.to(torch.int32)
    zero = zero.reshape(1, 1).expand(num_rows, 1) if zero.numel() == 1 else zero.reshape(num_rows, -1)
    return scale.contiguous(), zero.contiguous()
