"""Linear projections: plain, and several projections of one input fused into one matmul (:class:`MergedLinear`)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.ops import skinny_gemm

logger = logging.getLogger("pagedllm")


class Linear(nn.Linear):
    """``nn.Linear`` that can run from a packed copy of its weight on CPU (:meth:`pack_for_cpu`: the skinny
    GEMM for up to ``max_rows`` rows, oneDNN above). A run-time weight format sets ``quant_method``, which
    then owns the weight and the matmul (vLLM's ``LinearMethod``). ``bf16_math`` (opt-in, float32, AMX):
    oneDNN multiplies in bfloat16 and accumulates in float32; greedy outputs can change. ``lora``
    (``pagedllm.lora``, set with ``enable_lora``) adds its adapters' rows to the base output."""

    packed_weight: torch.Tensor | None = None  # oneDNN's blocked layout
    skinny_weight: skinny_gemm.SkinnyWeight | None = None
    quant_method = None  # a pagedllm.quantization.LinearMethod, or None for a float weight
    bf16_math = False
    # False for layers that rarely see more rows than MAX_ROWS (the LM head: its rows are the sampled ones)
    onednn_for_many_rows = True
    lora = None  # a pagedllm.lora.layer.LoRALayer, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_forward(x)
        return out if self.lora is None else self.lora.apply(x, out)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        if x.requires_grad and torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)  # the packed copies have no autograd link
        skinny = self.skinny_for(x)
        if skinny is not None:
            return skinny_gemm.skinny_linear(x, skinny)
        if self.packed_weight is not None:
            if self.bf16_math and x.shape[0] >= BF16_MATH_MIN_ROWS and x.dtype == torch.float32:
                return _packed_linear_bf16_math(x, self.packed_weight, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def skinny_for(self, x: torch.Tensor) -> skinny_gemm.SkinnyWeight | None:
        """The skinny GEMM weight that runs ``x``, or None (oneDNN or ``F.linear`` does)."""
        skinny = self.skinny_weight
        if skinny is not None and x.shape[0] <= skinny.max_rows and x.dtype == skinny.dtype \
                and x.dim() == 2 and x.stride(1) == 1 and not (x.requires_grad and torch.is_grad_enabled()):
            return skinny
        return None

    def pack_for_cpu(self, batch_hint: int, bf16_math: bool = False) -> bool:
        """Pack the weight for the skinny GEMM or oneDNN (CPU); returns whether it did (again after edits)."""
        self.unpack()  # counts as a packing change (packing_generation)
        w = getattr(self, "weight", None)
        if w is None or self.quant_method is not None or w.device.type != "cpu":
            return False
        plan = cpu_packing(w.dtype, w.shape[1], bf16_math, self.onednn_for_many_rows)
        if plan.skinny:
            self.skinny_weight = skinny_gemm.pack(w, self.bias)
        if plan.onednn:
            try:
                self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
            except (RuntimeError, AttributeError):  # a torch build without this private op
                self.packed_weight = None
        self.bf16_math = plan.bf16_math and self.packed_weight is not None
        return self.is_packed

    @property
    def is_packed(self) -> bool:
        return self.packed_weight is not None or self.skinny_weight is not None

    def unpack(self) -> None:
        global _packing_generation
        _packing_generation += 1
        self.packed_weight = None
        self.skinny_weight = None
        self.bf16_math = False


@dataclass(frozen=True)
class CpuPacking:

    skinny: bool
    onednn: bool
    bf16_math: bool


def cpu_packing(dtype: torch.dtype, in_features: int, bf16_math: bool = False,
                onednn_for_many_rows: bool = True) -> CpuPacking:
    """Which packed copies :meth:`Linear.pack_for_cpu` makes for a weight of ``dtype``."""
    if dtype not in (torch.float32, torch.bfloat16):
        return CpuPacking(False, False, False)
    bf16_math = bf16_math and dtype == torch.float32 and bf16_math_supported()
    skinny = not bf16_math and skinny_gemm.packs(dtype, in_features)
    # float32 without oneDNN's copy: F.linear takes the rows above MAX_ROWS
    skinny_alone = skinny and dtype == torch.float32 and not (onednn_for_many_rows and fp32_rows_use_onednn())
    onednn = onednn_packs(dtype) and not skinny_alone
    return CpuPacking(skinny, onednn, bf16_math and onednn)


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs ``dtype`` here (bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
    return dtype == torch.float32


def cpu_packed_copy_bytes(out_features: int, in_features: int, dtype: torch.dtype, bias: bool = False,
                          onednn_for_many_rows: bool = True) -> int:
    """Bytes :meth:`Linear.pack_for_cpu` would add for an ``(out_features, in_features)`` weight of ``dtype``."""
    plan = cpu_packing(dtype, in_features, onednn_for_many_rows=onednn_for_many_rows)
    elem = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 0
    total = out_features * in_features * elem if plan.onednn else 0
    if plan.skinny:
        total += skinny_gemm.packed_nbytes(out_features, in_features, dtype, bias)
    return total


_packing_generation = 0  # bumped by every Linear.unpack


def packing_generation() -> int:
    """Changes whenever any :class:`Linear` is packed or unpacked (recorded CPU graphs are then stale)."""
    return _packing_generation


PACKED_LINEAR_ENV = envs.CPU_PACKED_LINEAR.name


@functools.lru_cache(maxsize=None)
def fp32_rows_use_onednn() -> bool:
    """Whether float32 linears above the skinny GEMM's rows run from a oneDNN copy (MKL takes AVX2 paths on
    non-Intel CPUs). ``PAGEDLLM_CPU_FP32_PREFILL_LINEAR``: auto, onednn, blas; ValueError for another value."""
    value = envs.cpu_fp32_prefill_linear()
    if value != "auto":
        return value == "onednn"
    return cpu_vendor() != "GenuineIntel"


def cpu_vendor() -> str:
    """The CPU vendor string (``GenuineIntel``, ...) from /proc/cpuinfo, or ``""``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


_warned_no_amx: list[bool] = []


def bf16_math_supported() -> bool:
    """Whether this CPU has AMX tiles (``Linear.bf16_math``). Warns once where it does not."""
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    if not is_amx and not _warned_no_amx:
        _warned_no_amx.append(True)
        logger.warning("bfloat16 math for float32 linears needs AMX, which this CPU lacks: they stay float32")
    return is_amx


# fewer rows stream the float32 weight anyway: the conversion costs more than it saves
BF16_MATH_MIN_ROWS = 16


def _packed_linear_bf16_math(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's packed float32 linear with bfloat16 math for this call only (torch's setting is process-wide)."""
    knob = torch.backends.mkldnn.matmul
    previous = knob.fp32_precision
    knob.fp32_precision = "bf16"
    try:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    finally:
        knob.fp32_precision = previous


class MergedLinear(Linear):
    """Projections of one input stacked on the output axis: ``forward`` returns (T, sum(output_sizes))."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        """The rows of projection ``index`` inside ``param`` (weight or bias), a view."""
        offset = sum(self.output_sizes[:index])
        return param.narrow(0, offset, self.output_sizes[index])


def pack_linears_for_cpu(module: nn.Module, batch_hint: int = 64, bf16_math: bool = False) -> int:
    """Prepack every :class:`Linear` under ``module`` for oneDNN; returns how many were packed."""
    return sum(m.pack_for_cpu(batch_hint, bf16_math) for m in module.modules() if isinstance(m, Linear))


def packed_copy_bytes(module: nn.Module) -> int:
    """Bytes of the packed weight copies every :class:`Linear` under ``module`` holds next to its parameters."""
    total = 0
    for m in module.modules():
        if isinstance(m, Linear):
            if m.skinny_weight is not None:
                total += m.skinny_weight.nbytes
            if m.packed_weight is not None:
                total += m.packed_weight.numel() * m.packed_weight.element_size()
    return total


def unpack_linears(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, Linear):
            m.unpack()
