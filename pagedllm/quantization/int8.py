"""Weight-only int8: ``W[n, k] = q[n, k] * scale[n, k // group]`` with q int8.

Two scale layouts share one method:

- per output channel (``group_size=None``): ``scale`` (N,), symmetric, quantized here from
  any float checkpoint as ``scale = max|W[n]| / 127``, ``q = round(W / scale)``
  (the "weight-only int8" of torchao / vLLM);
- per group of ``group_size`` input features: ``scale`` (N, K / group), as GGUF Q8_0
  stores it (group 32), converted from the file without rounding.

Matmul: with bfloat16/float16 activations and at most ``kernel_max_tokens`` rows, torch's
CPU kernel ``aten._weight_int8pack_mm`` (per-channel scales only); otherwise the weight is
dequantized a tile of output rows at a time (:func:`~pagedllm.quantization.base.tiled_linear`);
per-channel scales are then applied to the matmul's output, not to every weight. torch's
kernel takes float32 activations too, but its float32 path is the generic one (an order of
magnitude slower than the tiles on this project's machines), so float32 models use tiles.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.quantization.base import LinearMethod, QuantizationConfig, replace_weight, tile_rows, tiled_linear

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def quantize_per_channel(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: weight (N, K) float -> (q (N, K) int8, scale (N,) float32).

    ``scale = max|W[n]| / 127`` (1 for an all-zero row), ``q = clamp(round(W / scale), -127, 127)``.
    ``absmax`` (N,) float32: the rows' max|W[n]| when ``weight`` holds only some of each row's
    columns (a row-parallel shard: the maximum over every rank's columns).
    """
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) if absmax is None else absmax) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(w / scale.unsqueeze(1)), -127, 127).to(torch.int8)
    return q, scale


class Int8LinearMethod(LinearMethod):
    """Keeps ``layer.qweight`` (N, K) int8 and ``layer.scales`` float32: (N,) per channel or
    (N, K / group_size) per group. Quantizes a loaded float weight (per channel) unless the
    layer already holds int8 data (set by :meth:`set_quantized`, e.g. from GGUF Q8_0)."""

    kernel_max_tokens = 16

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if hasattr(layer, "qweight"):
            return
        absmax = None
        if getattr(layer, "input_is_parallel", False):
            # a row-parallel shard holds K / N columns of each row: the scale is the whole
            # row's, so the quantized weight is the same whatever tensor_parallel_size
            from pagedllm.distributed.communication import all_reduce_max

            absmax = all_reduce_max(layer.weight.detach().float().abs().amax(dim=1))
        q, scale = quantize_per_channel(layer.weight, absmax)
        self.set_quantized(layer, q, scale)

    @staticmethod
    def set_quantized(layer: nn.Module, q: torch.Tensor, scales: torch.Tensor) -> None:
        """Store q (N, K) int8 and scales (N,) or (N, K / group) on ``layer``; drop its float weight."""
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
        """Rows [start, end) of W in ``dtype``; per-channel scales only when ``with_channel_scale``."""
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
        """The per-channel scales in the kernel's activation dtype (cached on the layer)."""
        cached = getattr(layer, "_kernel_scales", None)
        if cached is None or cached.dtype != dtype:
            cached = layer.scales.to(dtype)
            layer._kernel_scales = cached
        return cached


class Int8Config(QuantizationConfig):
    """``quantization="int8"``: every projection (not a tied LM head) per-channel int8."""

    name = "int8"

    def get_linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        return Int8LinearMethod()

