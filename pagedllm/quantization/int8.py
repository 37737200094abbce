"""Weight-only int8: ``W[n, k] = q[n, k] * scale[n, k // group]``.

Scales (N,) per channel (torchao's weight-only int8) or (N, K / group) as GGUF Q8_0 stores them.
float32 activations use the tiles: ``aten._weight_int8pack_mm``'s float32 path is the generic one.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.quantization.base import LinearMethod, QuantizationConfig, replace_weight, tile_rows, tiled_linear

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def quantize_per_channel(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) → (q int8, scale (N,) float32 = max|W[n]| / 127); ``absmax``: a shard's whole-row maxima."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) if absmax is None else absmax) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(w / scale.unsqueeze(1)), -127, 127).to(torch.int8)
    return q, scale


class Int8LinearMethod(LinearMethod):
    """Quantizes a loaded float weight per channel unless :meth:`set_quantized` filled it."""

    kernel_max_tokens = 16

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if hasattr(layer, "qweight"):
            return
        absmax = None
        if getattr(layer, "input_is_parallel", False):
            # the whole row's scale, so the result is the same whatever tensor_parallel_size
            from pagedllm.distributed.communication import all_reduce_max

            absmax = all_reduce_max(layer.weight.detach().float().abs().amax(dim=1))
        q, scale = quantize_per_channel(layer.weight, absmax)
        self.set_quantized(layer, q, scale)

    @staticmethod
    def set_quantized(layer: nn.Module, q: torch.Tensor, scales: torch.Tensor) -> None:
        """Store q (N, K) int8 and scales (N,) or (N, K / group); drop the float weight."""
        n, k = q.shape
        if scales.dim() == 2 and k % scales.shape[1]:
            raise ValueError(f"in_features {k} is not a multiple of the {scales.shape[1]} scale groups")
        device = layer.weight.device if isinstance(getattr(layer, "weight", None), torch.Tensor) else q.device
        replace_weight(layer, None)
        layer.register_buffer("qweight", q.to(device).contiguous())
        layer.register_buffer("scales", scales.to(device=device, dtype=torch.float32).contiguous())

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return self._rows(layer, 0, layer.qweight.shape[0], torch.float32, with_channel_scale=True)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        q, scales = layer.qweight, layer.scales
        per_channel = scales.dim() == 1
        if per_channel and x.dtype in KERNEL_DTYPES and x.shape[0] <= self.kernel_max_tokens and x.is_cpu:
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, self._scales_as(layer, x.dtype))
        else:
            out = tiled_linear(x, q.shape[0], lambda s, e: self._rows(layer, s, e, x.dtype, not per_channel),
                               tile_rows(q.shape[1], x.dtype))
            if per_channel:
                out.mul_(scales.to(x.dtype))
        return out if layer.bias is None else out.add_(layer.bias)

    @staticmethod
    def _rows(layer: nn.Module, start: int, end: int, dtype: torch.dtype, with_channel_scale: bool) -> torch.Tensor:
        q, scales = layer.qweight[start:end], layer.scales[start:end]
        if scales.dim() == 1:
            w = q.to(dtype)
            return w.mul_(scales.to(dtype).unsqueeze(1)) if with_channel_scale else w
        rows, k = q.shape
        groups = scales.shape[1]
        w = q.view(rows, groups, k // groups).to(dtype)  # (rows, groups, group_size)
        return w.mul_(scales.to(dtype).unsqueeze(2)).view(rows, k)

    @staticmethod
    def _scales_as(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        cached = getattr(layer, "_kernel_scales", None)
        if cached is None or cached.dtype != dtype:
            cached = layer.scales.to(dtype)
            layer._kernel_scales = cached
        return cached


class Int8Config(QuantizationConfig):
    """``quantization="int8"``: every projection but a tied LM head."""

    name = "int8"

    def get_linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        return Int8LinearMethod()

