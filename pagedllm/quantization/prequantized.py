"""Pre-quantized Hugging Face checkpoints (compressed-tensors, GPTQ, AWQ) kept as stored, on the int8 / int4 methods.

The checkpoint's tensors of each quantized projection are gathered from the weight stream and
converted exactly (no requantization) into pagedllm's forms, yielded under the projection's name:
- 4-bit: ``qweight`` (N, K / 2) uint8 nibbles u in [0, 15], ``scales`` and ``zeros`` (N, K / group)
  float32 with ``w = (u - 8) * scale + zero`` (:mod:`pagedllm.quantization.int4`), so a zero point z
  of ``w = (q - z) * s`` becomes ``zero = (8 - z) * s`` (exact for float16/bfloat16 scales).
- 8-bit: ``qweight`` (N, K) int8, ``scales`` (N,) per channel or (N, K / group)
  (:mod:`pagedllm.quantization.int8`); symmetric only.
The loader fills them into parameters of the same names (fused layers by rows), then
``process_weights_after_loading`` hands them to the int8 / int4 method. Groups torch's int4 kernel
does not take (per channel, 512, ...) are split into equal sub-groups, which is exact. Act-order
checkpoints (``g_idx``) keep their columns permuted so that groups are contiguous, with the
permutation kept as the layer's ``input_perm`` (K,) buffer: ``x @ W.T == x[:, input_perm] @ W_kept.T``;
the parts of a fused layer share their input, so they must share it (GPTQ gives them the same one).
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch
from torch import nn

from pagedllm.config import INT4_GROUP_SIZES
from pagedllm.loader.quantization_config import CheckpointQuantization, WeightScheme
from pagedllm.quantization import awq, compressed_tensors, gptq
from pagedllm.quantization.base import LinearMethod, QuantizationConfig, replace_weight
from pagedllm.quantization.int4 import Int4LinearMethod, pack_nibbles, unpack_nibbles
from pagedllm.quantization.int8 import Int8LinearMethod
from pagedllm.quantization.w8a8 import W8A8LinearMethod

logger = logging.getLogger("pagedllm")


def w8a8_linear_method(group_size: int | None) -> LinearMethod:
    """The method a W8A8 checkpoint's projections run on (int8 weights, int8 activations quantized per token at run
    time, the scheme's own forward): ``quantization/w8a8.py``'s method for per-channel weight scales. Group-wise
    weight scales (which W8A8's one rescale per output cannot take) run on the weight-only int8 method, activations
    staying float."""
    return W8A8LinearMethod(activation_group=None) if group_size is None else Int8LinearMethod()


def kept_group_size(group_size: int | None, in_features: int) -> int:
    """The int4 group kept for a checkpoint group (None: per channel): the largest of
    ``INT4_GROUP_SIZES`` dividing it. Raises ValueError when none does."""
    group = group_size or in_features
    for size in sorted(INT4_GROUP_SIZES, reverse=True):
        if group % size == 0:
            return size
    raise ValueError(f"quantization_config group size {group} (in_features {in_features}) is not a multiple "
                     f"of {min(INT4_GROUP_SIZES)}; pagedllm keeps int4 groups of {INT4_GROUP_SIZES}")


class PrequantizedLinearMethod(LinearMethod):
    """Holds the converted checkpoint values as parameters until loaded, then runs on ``inner``."""

    def __init__(self, scheme: WeightScheme, prefix: str, input_perms: dict[str, torch.Tensor]) -> None:
        self.scheme = scheme
        self.prefix = prefix
        self.input_perms = input_perms  # act-order: layer name -> permutation, filled by the conversion
        self.inner: LinearMethod | None = None

    @property
    def records_cpu_graphs(self) -> bool:
        """The inner method's, without an act-order permutation (a torch op before the kernel calls)."""
        return getattr(self.inner, "records_cpu_graphs", False) and not self.scheme.has_act_order

    def create_weights(self, layer: nn.Module) -> None:
        weight = layer.weight
        n, k = layer.out_features, layer.in_features
        if self.scheme.has_act_order:
            from pagedllm.distributed.parallel_state import get_tensor_parallel_size

            if get_tensor_parallel_size() > 1:
                raise ValueError(f"{self.prefix}: act-order checkpoints (quantization_config desc_act / actorder) "
                                 f"are not supported with tensor_parallel_size > 1")
        if self.scheme.bits == 4:
            group = kept_group_size(self.scheme.group_size, k)
            if k % (self.scheme.group_size or k):
                raise ValueError(f"{self.prefix}: quantization_config group size {self.scheme.group_size} does "
                                 f"not divide in_features {k}")
            self.inner = Int4LinearMethod(group)
            self.inner.create_weights(layer)  # ValueError for a tensor-parallel share the group does not divide
            shapes = {"qweight": ((n, k // 2), torch.uint8), "scales": ((n, k // group), torch.float32),
                      "zeros": ((n, k // group), torch.float32)}
        else:
            group = self.scheme.group_size
            self.inner = w8a8_linear_method(group) if self.scheme.dynamic_int8_activations else Int8LinearMethod()
            if group is not None and k % group:
                raise ValueError(f"{self.prefix}: quantization_config group size {group} does not divide "
                                 f"in_features {k}")
            scales = (n,) if group is None else (n, k // group)
            shapes = {"qweight": ((n, k), torch.int8), "scales": (scales, torch.float32)}
        layer.weight_dtype = weight.dtype
        replace_weight(layer, None)
        for name, (shape, dtype) in shapes.items():
            layer.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype, device=weight.device),
                                                        requires_grad=False))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        values = {name: layer._parameters.pop(name).data for name in ("qweight", "scales", "zeros")
                  if name in layer._parameters}
        if self.scheme.bits == 4:
            self.inner.set_quantized(layer, unpack_nibbles(values["qweight"]), values["scales"], values["zeros"])
        else:
            self.inner.set_quantized(layer, values["qweight"], values["scales"])
        if self.scheme.has_act_order:
            layer.register_buffer("input_perm", self.input_perms[self.prefix].to(values["qweight"].device))
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        perm = getattr(layer, "input_perm", None)
        return self.inner.apply(layer, x if perm is None else x.index_select(1, perm))

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        kept = self.inner.dequantize(layer)
        perm = getattr(layer, "input_perm", None)
        if perm is None:
            return kept
        weight = torch.empty_like(kept)
        weight[:, perm] = kept  # column perm[j] of the weight is kept column j
        return weight


class PrequantizedConfig(QuantizationConfig):
    """A pre-quantized checkpoint: which projections are quantized (the checkpoint's targets and
    ``ignore``), their tensors' names, and the conversion of the weight stream."""

    def __init__(self, quantization: CheckpointQuantization, fused_parts: dict[str, list[str]]) -> None:
        self.quantization = quantization
        self.fused_parts = fused_parts
        self.name = quantization.describe()
        self._schemes: dict[str, WeightScheme] = {}  # Hugging Face module name -> its scheme
        self._layer_of: dict[str, str] = {}  # Hugging Face module name -> pagedllm layer (fused or not)
        self._perms: dict[str, torch.Tensor] = {}  # act-order: pagedllm layer -> input permutation

    def get_linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        parent, _, leaf = prefix.rpartition(".")
        parts = [f"{parent}.{p}" if parent else p for p in self.fused_parts.get(leaf, [leaf])]
        schemes = [self.quantization.scheme_for(p) for p in parts]
        if all(s is None for s in schemes):
            return None
        if any(s != schemes[0] for s in schemes):
            raise ValueError(f"quantization_config gives the parts of {prefix} ({', '.join(parts)}) different "
                             f"schemes; pagedllm runs them as one fused projection and needs one scheme")
        if schemes[0].dynamic_int8_activations and not self._schemes \
                and not isinstance(w8a8_linear_method(schemes[0].group_size), W8A8LinearMethod):
            logger.info("W8A8 checkpoint: its int8 weights run on the weight-only int8 method, activations in "
                        "the model dtype (group-wise weight scales)")
        self._schemes.update((p, schemes[0]) for p in parts)
        self._layer_of.update((p, prefix) for p in parts)
        return PrequantizedLinearMethod(schemes[0], prefix, self._perms)

    @property
    def packed_weight_names(self) -> frozenset[str]:
        """The checkpoint tensors read as stored (not cast to the model dtype)."""
        return frozenset(f"{m}.{s}" for m in self._schemes for s in self._suffixes()[0])

    def _suffixes(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(every tensor suffix of a quantized projection, the optional ones)."""
        module = {"compressed-tensors": compressed_tensors, "gptq": gptq, "awq": awq}[self.quantization.quant_method]
        return module.SUFFIXES, module.OPTIONAL_SUFFIXES

    def _required(self, scheme: WeightScheme) -> tuple[str, ...]:
        method = self.quantization.quant_method
        if method == "compressed-tensors":
            required = compressed_tensors.required_suffixes(scheme)
        elif method == "gptq":
            required = gptq.REQUIRED_SUFFIXES
        else:
            required = awq.required_suffixes(not scheme.symmetric)
        return required + ((self._g_idx_suffix(),) if scheme.has_act_order else ())

    def _g_idx_suffix(self) -> str:
        return "weight_g_idx" if self.quantization.quant_method == "compressed-tensors" else "g_idx"

    def convert_checkpoint(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The weight stream with each quantized projection's tensors replaced by pagedllm's
        (``qweight``, ``scales``[, ``zeros``]) once all of them were read. Raises ValueError naming
        the tensors missing at the end, or a checkpoint this conversion cannot represent exactly."""
        suffixes, optional = self._suffixes()
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            module, _, suffix = name.rpartition(".")
            scheme = self._schemes.get(module)
            if scheme is None or suffix not in suffixes:
                yield name, tensor
                continue
            if suffix in optional and suffix not in self._required(scheme):
                self._check_optional(name, tensor, scheme)
                continue
            parts = pending.setdefault(module, {})
            parts[suffix] = tensor
            if all(s in parts for s in self._required(scheme)):
                yield from self._convert(module, pending.pop(module), scheme)
        if pending:
            missing = [f"{m}.{s}" for m, parts in pending.items() for s in self._required(self._schemes[m])
                       if s not in parts]
            raise ValueError(f"the checkpoint lacks tensors of its quantized projections: {', '.join(missing[:8])}")

    def _check_optional(self, name: str, tensor: torch.Tensor, scheme: WeightScheme) -> None:
        if name.endswith("g_idx"):
            gptq.check_group_order(tensor, scheme.group_size, name)

    def _convert(self, module: str, tensors: dict[str, torch.Tensor], scheme: WeightScheme
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """(q signed or unsigned, zero points or None, scales) in the checkpoint's convention → pagedllm's."""
        method = self.quantization.quant_method
        if method == "compressed-tensors":
            signed = compressed_tensors.signed_values(tensors, scheme)
            scales, zero_points = compressed_tensors.scales_and_zero_points(tensors, scheme, signed.shape[0])
            offset = 1 << (scheme.bits - 1)  # unsigned u = q + offset, zero point likewise
            q = signed + offset
            zeros = None if zero_points is None else zero_points + offset
        elif method == "gptq":
            q, zeros, scales = gptq.values_zeros_scales(tensors, scheme)
        else:
            q, zeros, scales = awq.values_zeros_scales(tensors)
        if scheme.has_act_order:
            perm = gptq.act_order_permutation(tensors[self._g_idx_suffix()], scheme.group_size, module)
            q = q[:, perm]
            self._keep_input_perm(module, perm)
        if scheme.bits == 4:
            yield from _as_int4(module, q, zeros, scales)
        else:
            yield from _as_int8(module, q, zeros, scales, scheme)

    def _keep_input_perm(self, module: str, perm: torch.Tensor) -> None:
        """Record the layer's input permutation; the parts of a fused layer must agree."""
        layer = self._layer_of[module]
        seen = self._perms.setdefault(layer, perm)
        if not torch.equal(seen, perm):
            raise ValueError(f"{module}: its act-order g_idx differs from the other parts of {layer}, which "
                             f"pagedllm runs as one projection on one input order")


def _as_int4(module: str, q: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """q (N, K) unsigned in [0, 15], zero points (N, G) unsigned (None: 8), scales (N, G)."""
    n, k = q.shape
    if k % scales.shape[1]:
        raise ValueError(f"{module}: {scales.shape[1]} scale groups do not divide in_features {k}")
    group = k // scales.shape[1]
    repeat = group // kept_group_size(group, k)
    zero_points = torch.full_like(scales, 8.0) if zeros is None else zeros.float()
    scales = scales.repeat_interleave(repeat, dim=1)
    offsets = (8.0 - zero_points).repeat_interleave(repeat, dim=1) * scales
    yield f"{module}.qweight", pack_nibbles(q.to(torch.uint8))
    yield f"{module}.scales", scales.contiguous()
    yield f"{module}.zeros", offsets.contiguous()


def _as_int8(module: str, q: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor,
             scheme: WeightScheme) -> Iterator[tuple[str, torch.Tensor]]:
    """q (N, K) unsigned in [0, 255]: symmetric, so the zero point is 128 everywhere."""
    if zeros is not None and not bool((zeros == 128).all()):
        raise ValueError(f"{module}: 8-bit weights with zero points other than 128 are not supported "
                         f"(quantization_config sym must be true)")
    yield f"{module}.qweight", (q - 128).to(torch.int8).contiguous()
    yield f"{module}.scales", (scales[:, 0] if scheme.group_size is None else scales).contiguous()
