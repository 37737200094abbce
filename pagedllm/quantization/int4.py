"""int4 weights: ``W[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]``, ``g = k // group_size``, q in [0, 15].

The form of torch's ``aten._weight_int4pack_mm_for_cpu`` (tinygemm); float checkpoints get
``scale = (max - min) / 15``, ``zero = min + 8 * scale``. ``qweight`` (N, K / 2) uint8, element 2j low nibble.

Where :func:`gguf_repack.available` (AVX512-VNNI), the codes are repacked once at load for the repacked GEMM
(``w = scale * q + (zero - 8 * scale)``, one scale and min per group) and every call quantizes its activations to
int8 blocks of 32 (:func:`gguf_dot.quantize_rows`, llama.cpp's Q8_0 rule), as llama.cpp runs its 4-bit types: the
products are integer sums rescaled per block, never a dequantized tile. Elsewhere the activations stay float:
torch's int4 kernel for a few bfloat16/float16 rows, else tiles of the weight dequantized to the activation dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.config import INT4_GROUP_SIZES as GROUP_SIZES
from pagedllm.distributed.parallel_state import get_tensor_parallel_size
from pagedllm.ops import gguf_repack
from pagedllm.quantization.gguf import GGUFTiedHeadMethod
from pagedllm.quantization.base import LinearMethod, QuantizationConfig, replace_weight, tile_rows, tiled_linear
from pagedllm.quantization.int8 import KERNEL_DTYPES


def quantize_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight (N, K) float → q (N, K) uint8 in [0, 15], scales and zeros (N, K / group) float32."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scales = (hi - lo) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.clamp(torch.round((w - lo.unsqueeze(2)) / scales.unsqueeze(2)), 0, 15).to(torch.uint8)
    return q.view(n, k), scales, lo + 8.0 * scales


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) uint8 in [0, 15], K even -> (N, K / 2) uint8: element 2j low nibble, 2j+1 high."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)


class Int4LinearMethod(LinearMethod):
    """Quantizes a loaded float weight unless :meth:`set_quantized` filled it; repacked (``int4_repacked``, the
    codes in ``int4_codes`` / ``int4_scale`` / ``int4_min``) where :func:`gguf_repack.available`, else ``qweight``,
    ``scales`` and ``zeros``. Raises ValueError naming the group."""

    kernel_max_tokens = 16

    def __init__(self, group_size: int = 128) -> None:
        if group_size not in GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {GROUP_SIZES} for int4, got {group_size}")
        self.group_size = group_size

    def create_weights(self, layer: nn.Module) -> None:
        if layer.in_features % self.group_size:
            tp = get_tensor_parallel_size()
            share = f" (this rank's share with tensor_parallel_size={tp})" if tp > 1 else ""
            raise ValueError(f"quantization_group_size {self.group_size} does not divide the layer's "
                             f"in_features {layer.in_features}{share}; choose one of {GROUP_SIZES} that does")

    @property
    def records_cpu_graphs(self) -> bool:
        """Repacked, a call's rows are two recorded kernel calls (pagedllm.worker.cpu_graph)."""
        return self.repacked

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not hasattr(layer, "qweight"):
            self.set_quantized(layer, *quantize_groups(layer.weight, self.group_size))
        self.repacked = layer.qweight.is_cpu and gguf_repack.available()
        if self.repacked:
            self._repack(layer)
            return
        # torch's kernel packs N in blocks of 16 rows
        if layer.weight_dtype in KERNEL_DTYPES and layer.qweight.is_cpu and layer.qweight.shape[0] % 16 == 0:
            q = unpack_nibbles(layer.qweight).to(torch.int32)
            layer.kernel_qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            scale_zero = torch.stack([layer.scales.t(), layer.zeros.t()], dim=-1)  # (K / group, N, 2)
            layer.kernel_scale_zero = scale_zero.to(layer.weight_dtype).contiguous()

    repacked = False

    @staticmethod
    def _repack(layer: nn.Module) -> None:
        """qweight, scales and zeros replaced by the repacked layout (min = zero - 8 * scale, in float32)."""
        q, scales, zeros = unpack_nibbles(layer.qweight), layer.scales, layer.zeros
        group = q.shape[1] // scales.shape[1]
        w = gguf_repack.repack_codes(q, scales, zeros - 8.0 * scales, 4, group)
        for name in ("qweight", "scales", "zeros"):
            del layer._buffers[name]
        for name in ("codes", "scale", "min"):
            layer.register_buffer(f"int4_{name}", getattr(w, name))
        layer.int4_repacked = w
        layer.int4_bias = None if layer.bias is None else layer.bias.detach().float().contiguous()

    @staticmethod
    def set_quantized(layer: nn.Module, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """Store q (N, K) packed and scales/zeros; drop the float weight, keeping its dtype as ``weight_dtype``."""
        weight = layer._parameters.get("weight")
        device = weight.device if weight is not None else q.device
        layer.weight_dtype = weight.dtype if weight is not None and weight.is_floating_point() \
            else getattr(layer, "weight_dtype", torch.float32)
        replace_weight(layer, None)
        layer.register_buffer("qweight", pack_nibbles(q.to(device)).contiguous())
        layer.register_buffer("scales", scales.to(device=device, dtype=torch.float32).contiguous())
        layer.register_buffer("zeros", zeros.to(device=device, dtype=torch.float32).contiguous())

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        if self.repacked:
            return gguf_repack.values(layer.int4_repacked)
        return self._rows(layer, 0, layer.qweight.shape[0], torch.float32)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.repacked:
            return self._repacked_dot(layer, x)
        kernel_q = getattr(layer, "kernel_qweight", None)
        if kernel_q is not None and x.dtype == layer.kernel_scale_zero.dtype and x.shape[0] <= self.kernel_max_tokens:
            group = layer.qweight.shape[1] * 2 // layer.scales.shape[1]
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), kernel_q, group, layer.kernel_scale_zero)
        else:
            n, half_k = layer.qweight.shape
            out = tiled_linear(x, n, lambda s, e: self._rows(layer, s, e, x.dtype), tile_rows(2 * half_k, x.dtype))
        return out if layer.bias is None else out.add_(layer.bias)

    @staticmethod
    def _repacked_dot(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x (T, K) float quantized to int8 blocks of 32, times the repacked codes: (T, N) in x's dtype."""
        out = gguf_repack.linear([layer.int4_repacked], x if x.dtype in (torch.float32, torch.bfloat16) else x.float(),
                                 layer.int4_bias)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    @staticmethod
    def _rows(layer: nn.Module, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        q = unpack_nibbles(layer.qweight[start:end])  # (rows, K) uint8
        scales, zeros = layer.scales[start:end], layer.zeros[start:end]
        rows, k = q.shape
        groups = scales.shape[1]
        w = q.view(rows, groups, k // groups).to(dtype).sub_(8)  # (rows, groups, group_size)
        w = torch.addcmul(zeros.to(dtype).unsqueeze(2), w, scales.to(dtype).unsqueeze(2))
        return w.view(rows, k)


# The group a float checkpoint gets when it divides in_features (torchao's int4 default), else the
# largest of GROUP_SIZES that does.
PREFERRED_GROUP_SIZE = 128
# A GGUF file's quantized blocks are on a grid of 32 input features (Q4_0/Q4_1/Q5_*/Q8_0 blocks, the
# sub-blocks of Q4_K/Q5_K); groups on that grid keep the file's own scale boundaries.
GGUF_GRID = 32
_GGUF_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def choose_group_size(in_features: int, checkpoint_kinds: set | None = None) -> int | None:
    """The int4 group for a layer: ``GGUF_GRID`` when its checkpoint tensors are GGUF-quantized, else
    ``PREFERRED_GROUP_SIZE``, else the largest of ``GROUP_SIZES`` that divides ``in_features`` (None: none does)."""
    dividing = [g for g in GROUP_SIZES if in_features % g == 0]
    if checkpoint_kinds and all(getattr(k, "name", str(k)) not in _GGUF_FLOAT_TYPES for k in checkpoint_kinds) \
            and GGUF_GRID in dividing:
        return GGUF_GRID
    if PREFERRED_GROUP_SIZE in dividing:
        return PREFERRED_GROUP_SIZE
    return max(dividing, default=None)


class Int4Config(QuantizationConfig):
    """``quantization="int4"``: every projection; a tied LM head too where the repacked GEMM runs, as Q8_0 blocks
    (:meth:`get_tied_head_method`). ``group_size`` None: chosen per layer (:func:`choose_group_size`; GGUF
    ``tensor_types`` and ``fused_parts`` name each layer's checkpoint tensors). Raises ValueError for a group size
    torch's kernel does not take, or a layer no group divides."""

    name = "int4"

    def __init__(self, group_size: int | None = 128, tensor_types: dict | None = None,
                 fused_parts: dict[str, list[str]] | None = None) -> None:
        if group_size is not None:
            Int4LinearMethod(group_size)  # validate now
        self.group_size = group_size
        self.tensor_types = tensor_types or {}
        self.fused_parts = fused_parts or {}
        self.chosen: dict[int, int] = {}  # group size -> layers
        self.head_q8_0 = False

    def get_linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        group = self.group_size
        if group is None:
            group = choose_group_size(layer.in_features, self._checkpoint_kinds(prefix))
            if group is None:
                raise ValueError(f"no int4 group size of {GROUP_SIZES} divides the in_features {layer.in_features} "
                                 f"of {prefix}; leave quantization unset or use int8")
        self.chosen[group] = self.chosen.get(group, 0) + 1
        return Int4LinearMethod(group)

    def get_tied_head_method(self, layer: nn.Module) -> LinearMethod | None:
        """Where the repacked GEMM runs (tensor_parallel_size 1, float32/bfloat16 weights), a head tied to the
        embedding as Q8_0 blocks of its rows (:class:`GGUFTiedHeadMethod`: int8 per block of 32, llama.cpp's usual
        head type; 4 bits would cost the logits more than any projection), else None (the head stays float: its
        weight stream is most of a small model's decode step). The embedding keeps its float rows unless they are
        exactly those blocks' values (a GGUF file's Q8_0 embedding), then looks them up in the head's codes."""
        if not gguf_repack.available() or layer.in_features % 32 or get_tensor_parallel_size() != 1 \
                or layer.weight.dtype not in (torch.float32, torch.bfloat16) or not layer.weight.is_cpu:
            return None
        self.head_q8_0 = True
        return GGUFTiedHeadMethod(layer.out_features)

    def describe(self) -> str:
        groups = ", ".join(f"group {g}: {n} layers" for g, n in sorted(self.chosen.items()))
        how = "given" if self.group_size is not None else "chosen per layer"
        layout = "; repacked for AVX512-VNNI, int8 activations" if self.chosen and gguf_repack.available() else ""
        head = "; tied LM head Q8_0" if self.head_q8_0 else ""
        return f"int4 ({groups}; {how}{layout}{head})"

    def _checkpoint_kinds(self, prefix: str) -> set | None:
        """The GGUF tensor types of the checkpoint tensors the layer ``prefix`` is loaded from (None: not GGUF)."""
        if not self.tensor_types:
            return None
        parent, _, leaf = prefix.rpartition(".")
        parts = [f"{parent}.{p}.weight" if parent else f"{p}.weight" for p in self.fused_parts.get(leaf, [leaf])]
        if not all(p in self.tensor_types for p in parts):  # stored fused under its own name
            parts = [f"{prefix}.weight"]
        kinds = {self.tensor_types.get(p) for p in parts}
        return None if None in kinds else kinds
