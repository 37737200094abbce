"""W8A8: int8 weights per output channel, int8 activations per token (dynamic, symmetric), int32 sums,
one float rescale:

    out[m, n] = float(sum_k xq[m, k] * q[n, k]) * (sx[m] * sw[n])  (+ bias[n]), rounded in that order
    sx[m] = max_k |x[m, k]| / 127 (1 for a zero row), xq = round-half-even(x / sx) clamped to [-127, 127]
    q, sw: :func:`pagedllm.quantization.int8.quantize_per_channel` (round(W / sw), sw = max_k |W[n]| / 127)

A call with at most :data:`KERNEL_MAX_ROWS` rows (decode) runs ``native/int8_gemm.c`` on a copy of the
weight packed in panels; more rows (prefill) run oneDNN's int8 matmul (``torch._int_mm``) on a (K, N)
copy. Integer sums are exact and both paths round the rescale identically, so a row's output is the same
bits whatever rows share its call (batch-invariant). bfloat16 activations are rescaled in float32 and
rounded once to bfloat16. Under tensor parallelism a row-parallel shard (o_proj, down_proj) takes each token's
scale over the whole row (the ranks' maxima all-reduced) and runs the torch formula, so TP=2 equals TP=1 up to
the float order of the ranks' sum.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.communication import all_reduce_max
from pagedllm.distributed.parallel_state import get_tensor_parallel_size
from pagedllm.ops import int8_gemm
from pagedllm.quantization.base import QuantizationConfig
from pagedllm.quantization.int8 import Int8LinearMethod

__all__ = ["KERNEL_MAX_ROWS", "W8A8Config", "W8A8LinearMethod", "quantize_per_token", "w8a8_matmul"]

# Rows up to which the C kernel beats torch._int_mm (benchmarks/int8_gemm.py).
KERNEL_MAX_ROWS = 64


def quantize_per_token(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> (xq (M, K) int8, sx (M,) float32); the C kernel's formula bit for bit. ``amax`` (M,):
    each row's maximum |x| when x is a slice of the rows (a row-parallel shard), else computed."""
    amax = x.abs().amax(dim=1) if amax is None else amax
    sx = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    xq = torch.round(x / sx.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return xq, sx


def w8a8_matmul(x: torch.Tensor, q_kn: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None, amax: torch.Tensor | None = None) -> torch.Tensor:
    """The formula in torch: x (M, K) float32, q_kn (K, N) int8, scales (N,) float32 -> (M, N) float32; ``amax``
    as :func:`quantize_per_token` takes it."""
    xq, sx = quantize_per_token(x, amax)
    if x.is_cpu:
        acc = torch._int_mm(xq, q_kn).float()
    else:  # no general int8 matmul off the CPU: float64 holds the int32 sums exactly
        acc = (xq.double() @ q_kn.double()).float()
    out = acc.mul_(sx.unsqueeze(1) * scales.unsqueeze(0))
    return out if bias is None else out.add_(bias.float())


class W8A8LinearMethod(Int8LinearMethod):
    """Per-channel int8 weights (quantized at load, or given by :meth:`set_quantized`) kept as a (K, N) copy
    for ``torch._int_mm`` and, on the CPU with the C kernel built, in its panels (``kernel_panels``). A layer
    whose rows are few by design (``onednn_for_many_rows`` False: the LM head, fed the sampled rows) keeps
    the panels alone and runs every row count in the C kernel. Raises ValueError for group-wise scales
    (W8A8 takes one scale per output channel)."""

    kernel_max_rows = KERNEL_MAX_ROWS
    # float32 rows up to kernel_max_rows run one recorded C call (pagedllm.worker.cpu_graph)
    records_cpu_graphs = True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        if layer.scales.dim() != 1:
            raise ValueError("quantization='w8a8' needs one weight scale per output channel, got "
                             f"{layer.scales.shape[1]} groups per row")
        q = layer.qweight
        del layer._buffers["qweight"]
        layer.int8_weight = None
        if q.is_cpu and int8_gemm.load_kernel() is not None:
            int8_gemm.isa()  # a bad envs.INT8_GEMM_ISA fails the load, not the first step
            packed = int8_gemm.pack(q, layer.scales, layer.bias)
            layer.int8_weight = packed
            layer.kernel_panels = packed.panels
            if not getattr(layer, "onednn_for_many_rows", True):
                return
        layer.register_buffer("qweight", q.t().contiguous().t())  # (N, K) view of the (K, N) copy _int_mm reads

    @staticmethod
    def set_quantized(layer: nn.Module, q: torch.Tensor, scales: torch.Tensor) -> None:
        """Store q (N, K) int8 in [-127, 127] and scales (N,); drop the float weight (packed after loading)."""
        if scales.dim() != 1:
            raise ValueError(f"quantization='w8a8' needs scales of shape (out_features,), got {tuple(scales.shape)}")
        Int8LinearMethod.set_quantized(layer, q, scales)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        q = layer.qweight if "qweight" in layer._buffers else int8_gemm.unpack(layer.int8_weight)
        return q.float() * layer.scales.unsqueeze(1)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x32 = x if x.dtype == torch.float32 else x.float()
        packed = getattr(layer, "int8_weight", None)
        if getattr(layer, "input_is_parallel", False) and get_tensor_parallel_size() > 1:
            # a row-parallel shard sees a slice of each token: its scale is the whole row's (the maximum over the
            # ranks, one all-reduce), so the ranks' integer sums add up to TP=1's
            amax = all_reduce_max(x32.abs().amax(dim=1))
            out = w8a8_matmul(x32, layer.qweight.t(), layer.scales, layer.bias, amax)
        elif packed is not None and x32.is_cpu and (x32.shape[0] <= self.kernel_max_rows
                                                  or "qweight" not in layer._buffers):
            out = int8_gemm.int8_linear(x32 if x32.stride(1) == 1 else x32.contiguous(), packed)
        else:
            out = w8a8_matmul(x32, layer.qweight.t(), layer.scales, layer.bias)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


class W8A8Config(QuantizationConfig):
    """``quantization="w8a8"``: every projection, a tied LM head included (the embedding keeps its float
    rows; the head's weight stream is a large share of a small model's decode step)."""

    name = "w8a8"
    quantizes_tied_head = True

    def get_linear_method(self, prefix: str, layer: nn.Module) -> W8A8LinearMethod:
        return W8A8LinearMethod()
