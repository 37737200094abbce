"""W8A8: int8 weights per output channel, int8 activations per token group (dynamic, symmetric), exact int32
sums per group, float rescales:

    out[m, n] = (sum_g float(sum_{k in g} xq[m, k] * q[n, k]) * sx[m, g]) * sw[n]  (+ bias[n])
    sx[m, g] = max_{k in g} |x[m, k]| / 127 (1 for a zero group, NaN for one holding a NaN or an infinity, whose
    codes are 0), xq = round-half-even(x / sx) clamped to [-127, 127]; q in [-128, 127] and sw per channel:
    :func:`pagedllm.quantization.int8.quantize_per_channel` (round(W / sw), sw = max_k |W[n]| / 127)

each operation rounded on its own in float32, the groups added in order. A group is :data:`ACTIVATION_GROUP`
consecutive input features (the last one of a row ends at K); ``activation_group=None`` is one group per row,
per-token quantization (a compressed-tensors W8A8 checkpoint's own scheme). Groups because one scale per
token is set by its largest feature: the few outlier channels of small models' hidden states leave the
other features a handful of int8 steps (docs/quantization.md has the perplexity per group size).

On the CPU every row count runs ``native/int8_gemm.c`` on a copy of the weight packed in panels (oneDNN's int8
matmul takes one activation scale per row only); elsewhere, and for a row-parallel shard whose groups straddle the
ranks, the torch formula below. Both give the same bits for a row
whatever rows share its call (batch-invariant). bfloat16 activations are rescaled in float32 and rounded once
to bfloat16. A row-parallel shard (o_proj, down_proj) cut along group boundaries holds whole groups and runs the
C kernel on its slice; one whose groups straddle two ranks (or per-token scales) takes each group's scale over the
whole row (the ranks' maxima all-reduced) and sums its own groups' share in the torch formula. Either way TP=2
equals TP=1 up to the float order of the ranks' sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.communication import all_reduce_max
from pagedllm.distributed.parallel_state import get_tensor_parallel_rank, get_tensor_parallel_size
from pagedllm.ops import int8_gemm
from pagedllm.quantization.base import QuantizationConfig
from pagedllm.quantization.int8 import Int8LinearMethod

__all__ = ["ACTIVATION_GROUP", "W8A8Config", "W8A8LinearMethod", "quantize_activations", "w8a8_matmul"]

# input features per activation scale of quantization="w8a8" (a multiple of the kernel's 4)
ACTIVATION_GROUP = 64


def _grouped(x: torch.Tensor, group: int, offset: int) -> tuple[torch.Tensor, int]:
    """x (M, K) -> ((M, G, group) zero-padded, first global group): column c of x is feature offset + c of a row
    cut in groups of ``group`` from feature 0."""
    lead = offset % group
    num_groups = -(-(lead + x.shape[1]) // group)
    padded = F.pad(x, (lead, num_groups * group - lead - x.shape[1]))
    return padded.view(x.shape[0], num_groups, group), offset // group


def _quantize_groups(xg: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """xg (M, G, group) float32 and its groups' maxima (M, G) -> (codes (M, G, group) float32, sx (M, G)). A group
    holding a NaN or an infinity gets sx = NaN and codes 0, so its outputs are NaN, as a float matmul's would be."""
    finite = torch.isfinite(xg).all(dim=2)
    sx = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    sx = torch.where(finite, sx, torch.full_like(sx, float("nan")))
    codes = torch.round(xg / sx.unsqueeze(2)).clamp_(-127, 127)
    return torch.where(finite.unsqueeze(2), codes, torch.zeros_like(codes)), sx


def quantize_activations(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> (xq (M, K) int8, sx (M, G) float32), G = ceil(K / group) (1 for group None): the C
    kernel's quantization bit for bit."""
    group = x.shape[1] if group is None or group >= x.shape[1] else group
    xg, _ = _grouped(x, max(group, 1), 0)
    xq, sx = _quantize_groups(xg, xg.abs().amax(dim=2))
    return xq.to(torch.int8).view(x.shape[0], -1)[:, :x.shape[1]], sx


def w8a8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                group: int | None, offset: int = 0, full_in_features: int | None = None) -> torch.Tensor:
    """The formula in torch: x (M, K) float32, q (N, K) int8, scales (N,) float32 -> (M, N) float32, activation
    groups of ``group`` features (None: one per row). A row-parallel shard passes ``offset`` (its first feature in
    the whole row) and ``full_in_features`` (the whole row's): its groups' maxima are all-reduced over the ranks
    (the groups of the whole row, each rank's zero where it holds none of it) and its output is its groups'
    share, which the ranks' sum completes."""
    full = x.shape[1] if full_in_features is None else full_in_features
    group = full if group is None or group >= full else group
    xg, first = _grouped(x, group, offset)
    qg, _ = _grouped(q, group, offset)
    amax = xg.abs().amax(dim=2)
    if full_in_features is not None:
        whole = amax.new_zeros(x.shape[0], -(-full // group))
        whole[:, first:first + amax.shape[1]] = amax
        amax = all_reduce_max(whole)[:, first:first + amax.shape[1]]
    xq, sx = _quantize_groups(xg, amax)
    f = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float32, device=x.device)
    for g in range(xg.shape[1]):  # float64 holds each group's int32 sums exactly
        acc = (xq[:, g].double() @ qg[:, g].double().t()).float()
        f = f + acc * sx[:, g:g + 1]
    out = f * scales.unsqueeze(0)
    return out if bias is None else out + bias.float()


class W8A8LinearMethod(Int8LinearMethod):
    """Per-channel int8 weights (quantized at load, or given by :meth:`set_quantized`), activations in groups of
    ``activation_group`` input features (None: one per row). On the CPU with the C kernel built the weight is kept
    in its panels alone (``kernel_panels``), except on a row-parallel shard whose groups straddle the ranks
    (:meth:`_spans_ranks`), which keeps q (N, K) for the torch formula. Raises ValueError for group-wise weight
    scales (W8A8 takes one scale per output channel) and for an activation group that is not a positive multiple
    of 4."""

    # rows run one recorded C call (pagedllm.worker.cpu_graph)
    records_cpu_graphs = True

    def __init__(self, activation_group: int | None = ACTIVATION_GROUP) -> None:
        int8_gemm.check_activation_group(activation_group)
        self.activation_group = activation_group

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        if layer.scales.dim() != 1:
            raise ValueError("quantization='w8a8' needs one weight scale per output channel, got "
                             f"{layer.scales.shape[1]} groups per row")
        layer.int8_weight = None
        if layer.qweight.is_cpu and int8_gemm.load_kernel() is not None and not self._spans_ranks(layer):
            int8_gemm.isa()  # a bad envs.INT8_GEMM_ISA fails the load, not the first step
            packed = int8_gemm.pack(layer.qweight, layer.scales, layer.bias, self.activation_group)
            layer.int8_weight = packed
            layer.kernel_panels = packed.panels
            del layer._buffers["qweight"]

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
        if self._spans_ranks(layer):
            # a shard sees a slice of each token: its groups' scales are the whole row's (one all-reduce), so the
            # ranks' shares add up to TP=1's output
            k = x32.shape[1]
            out = w8a8_matmul(x32, layer.qweight, layer.scales, layer.bias, self.activation_group,
                              offset=get_tensor_parallel_rank() * k, full_in_features=k * get_tensor_parallel_size())
        elif packed is not None and x32.is_cpu:
            out = int8_gemm.int8_linear(x32 if x32.stride(1) == 1 else x32.contiguous(), packed)
        else:
            out = w8a8_matmul(x32, layer.qweight, layer.scales, layer.bias, self.activation_group)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


    def _spans_ranks(self, layer: nn.Module) -> bool:
        """Whether an activation group of this layer straddles tensor-parallel ranks: a row-parallel shard under
        TP > 1 whose slice of the row is not a whole number of groups (per-token scales always are). Such a
        shard needs the row's maxima from every rank; one cut along group boundaries runs the C kernel alone."""
        if not getattr(layer, "input_is_parallel", False) or get_tensor_parallel_size() == 1:
            return False
        k = layer.qweight.shape[1] if "qweight" in layer._buffers else layer.int8_weight.in_features
        return self.activation_group is None or k % self.activation_group != 0


class W8A8Config(QuantizationConfig):
    """``quantization="w8a8"``: every projection, a tied LM head included (the embedding keeps its float
    rows; the head's weight stream is a large share of a small model's decode step), activations in groups of
    :data:`ACTIVATION_GROUP` features."""

    name = "w8a8"
    quantizes_tied_head = True

    def get_linear_method(self, prefix: str, layer: nn.Module) -> W8A8LinearMethod:
        return W8A8LinearMethod(ACTIVATION_GROUP)
