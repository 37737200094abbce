"""Linear projections: plain, and several projections of one input fused into one matmul.

:class:`Linear` can run from a oneDNN-prepacked copy of its weight on CPU. :class:`MergedLinear`
stacks projections that read the same input (q/k/v, gate/up) on the output axis; checkpoints
store them apart, so it tells the loader which rows each one fills (:meth:`MergedLinear.shard`).
A mixture-of-experts block slots in where a dense MLP is: it only needs
``forward(x: (T, hidden)) -> (T, hidden)`` and parameters named as its checkpoint names them.
"""

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
    """``nn.Linear`` that can run from a packed copy of its weight on CPU.

    :meth:`pack_for_cpu` packs the weight once for the engine's skinny GEMM
    (:mod:`pagedllm.ops.skinny_gemm`; float32, and bfloat16 on AMX or AVX512-BF16), which runs
    inputs of up to ``skinny_weight.max_rows`` rows (decode steps). Larger inputs (prefill
    chunks) run in float32 ``F.linear`` on Intel CPUs (as fast there as a prepacked oneDNN
    weight) and elsewhere oneDNN from a second copy (:func:`fp32_rows_use_onednn`), and, in
    bfloat16, oneDNN from a second copy reordered into its blocked layout (the same prepacking
    torch.compile's CPU freezing pass does; forward calls the oneDNN linear directly instead of
    re-packing the weight inside every matmul). Without the skinny kernel (off, or ``bf16_math``
    asked for) only the oneDNN copy is made (:func:`cpu_packing` is the rule). Measurements in
    ``benchmarks/results/``.

    The packed copy lives on the CPU: pack after the model reaches its device (as
    ``load_weights`` does), not before a ``.to("cuda")``.

    A weight format kept at run time (:mod:`pagedllm.quantization`) sets ``quant_method``:
    the method then owns the weight and computes the matmul (vLLM's ``LinearMethod`` seam).

    Opt-in, float32 only: with ``bf16_math`` set by :meth:`pack_for_cpu`, a packed float32
    linear of at least :data:`BF16_MATH_MIN_ROWS` rows lets oneDNN round x and the weight to
    bfloat16 and multiply on AMX, accumulating and returning float32 (on CPUs without AMX
    oneDNN takes the hint for some shapes only, with other rounding, so there the opt-in is
    refused with a warning and the linears stay float32) (what
    ``torch.set_float32_matmul_precision("medium")`` selects for every oneDNN matmul, here only
    for these linears). Not float32's numerics: greedy outputs can change.
    """

    packed_weight: torch.Tensor | None = None  # oneDNN's blocked layout
    skinny_weight: skinny_gemm.SkinnyWeight | None = None
    quant_method = None  # a pagedllm.quantization.LinearMethod, or None for a float weight
    bf16_math = False  # see pack_for_cpu
    # float32 rows above the skinny GEMM's MAX_ROWS from a oneDNN copy where fp32_rows_use_onednn();
    # False for layers that rarely see that many rows (the LM head: its rows are the sampled ones)
    onednn_for_many_rows = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, in_features) -> (T, out_features)."""
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
        """The skinny GEMM weight that runs ``x`` (at most its ``max_rows`` rows, its dtype, 2-D with
        contiguous rows, not grad-tracked: the packed copy has no autograd link), or None: oneDNN or
        ``F.linear`` does."""
        skinny = self.skinny_weight
        if skinny is not None and x.shape[0] <= skinny.max_rows and x.dtype == skinny.dtype \
                and x.dim() == 2 and x.stride(1) == 1 and not (x.requires_grad and torch.is_grad_enabled()):
            return skinny
        return None

    def pack_for_cpu(self, batch_hint: int, bf16_math: bool = False) -> bool:
        """Pack the weight for the skinny GEMM or oneDNN (CPU, float32/bfloat16 only); returns
        whether it did.

        The packed copies are extra memory (one more copy of the weight; two for bfloat16 with
        a skinny kernel, and for float32 where prefill rows run oneDNN); ``self.weight`` stays
        valid, but they do not follow later in-place edits of it: call this again
        (``load_weights`` does) after changing weights (CPU decode graphs recorded before are
        then dropped: :func:`packing_generation`). ``bf16_math``: float32 matmuls of many rows
        computed in bfloat16 (see the class docstring; opt-in).
        ``batch_hint``: the row count oneDNN's layout is chosen for.
        """
        self.unpack()  # (counts as a packing change: see packing_generation)
        w = getattr(self, "weight", None)
        if w is None or self.quant_method is not None or w.device.type != "cpu":
            return False
        plan = cpu_packing(w.dtype, w.shape[1], bf16_math, self.onednn_for_many_rows)
        if plan.skinny:
            self.skinny_weight = skinny_gemm.pack(w, self.bias)
        if plan.onednn:
            try:
                self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
            except (RuntimeError, AttributeError):  # a torch build without this private op: stay plain
                self.packed_weight = None
        self.bf16_math = plan.bf16_math and self.packed_weight is not None
        return self.is_packed

    @property
    def is_packed(self) -> bool:
        """Whether forward runs from a packed copy (:meth:`pack_for_cpu`)."""
        return self.packed_weight is not None or self.skinny_weight is not None

    def unpack(self) -> None:
        """Back to the plain ``F.linear`` path."""
        global _packing_generation
        _packing_generation += 1
        self.packed_weight = None
        self.skinny_weight = None
        self.bf16_math = False


@dataclass(frozen=True)
class CpuPacking:
    """The copies :meth:`Linear.pack_for_cpu` keeps of one CPU weight (see :func:`cpu_packing`)."""

    skinny: bool  # a skinny GEMM copy for decode rows
    onednn: bool  # oneDNN's blocked copy (prefill rows, bf16_math, or everything without the skinny GEMM)
    bf16_math: bool  # the opt-in float32-as-bfloat16 matmuls (oneDNN copy only)


def cpu_packing(dtype: torch.dtype, in_features: int, bf16_math: bool = False,
                onednn_for_many_rows: bool = True) -> CpuPacking:
    """Which packed copies :meth:`Linear.pack_for_cpu` makes on this host for a weight of
    ``dtype`` with ``in_features`` columns: the one rule both the packing and the capacity plan
    (:func:`cpu_packed_copy_bytes`) follow. float32 with the skinny GEMM keeps no oneDNN copy
    unless its prefill rows go to oneDNN (:func:`fp32_rows_use_onednn`, ``onednn_for_many_rows``);
    bfloat16 keeps both (oneDNN for rows above the skinny kernel's); ``bf16_math`` (float32,
    where supported) only oneDNN's. Other dtypes: none."""
    if dtype not in (torch.float32, torch.bfloat16):
        return CpuPacking(False, False, False)
    bf16_math = bf16_math and dtype == torch.float32 and bf16_math_supported()  # refused: float32 as usual
    skinny = not bf16_math and skinny_gemm.packs(dtype, in_features)
    # float32 without oneDNN's copy: F.linear takes the rows above MAX_ROWS (as fast as oneDNN here, or rare)
    skinny_alone = skinny and dtype == torch.float32 and not (onednn_for_many_rows and fp32_rows_use_onednn())
    onednn = onednn_packs(dtype) and not skinny_alone
    return CpuPacking(skinny, onednn, bf16_math and onednn)


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs ``dtype`` on this CPU: float32 wherever torch has
    oneDNN; bfloat16 only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT (oneDNN refuses to reorder a
    bfloat16 weight elsewhere, e.g. on AVX2-only hosts, where such weights stay on ``F.linear``)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
    return dtype == torch.float32


def cpu_packed_copy_bytes(out_features: int, in_features: int, dtype: torch.dtype, bias: bool = False,
                          onednn_for_many_rows: bool = True) -> int:
    """Bytes :meth:`Linear.pack_for_cpu` would add on this host next to a ``(out_features,
    in_features)`` weight of ``dtype`` (what :func:`packed_copy_bytes` counts once it has run),
    without making the copies: for ``pagedllm plan``."""
    plan = cpu_packing(dtype, in_features, onednn_for_many_rows=onednn_for_many_rows)
    elem = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 0
    total = out_features * in_features * elem if plan.onednn else 0  # oneDNN's blocked layout: no padding
    if plan.skinny:
        total += skinny_gemm.packed_nbytes(out_features, in_features, dtype, bias)
    return total


_packing_generation = 0  # bumped by every Linear.unpack (so by every pack_for_cpu too)


def packing_generation() -> int:
    """A counter that changes whenever any :class:`Linear` is packed or unpacked: what was recorded
    against the packed copies (CPU decode graphs, :mod:`pagedllm.worker.cpu_graph`) is stale once
    it differs from the value seen at recording."""
    return _packing_generation


PACKED_LINEAR_ENV = envs.CPU_PACKED_LINEAR.name  # planner.py reads it


@functools.lru_cache(maxsize=None)
def fp32_rows_use_onednn() -> bool:
    """Whether float32 linears of more rows than the skinny GEMM takes (prefill chunks) run from a
    oneDNN packed copy of the weight instead of ``F.linear`` (torch's BLAS, MKL in its CPU wheels).

    MKL takes AVX2 code paths on CPUs other than Intel's: on an AMD EPYC with AVX-512, oneDNN's
    packed linear ran SmolLM2's projections in 0.51x ``F.linear``'s time at 256 and 2,048 rows,
    while on an Intel Xeon the two were within 3% (``benchmarks/linear_kernels.py``, results in
    ``benchmarks/results/``). ``PAGEDLLM_CPU_FP32_PREFILL_LINEAR``: ``auto`` (default) keeps the
    oneDNN copy (one more copy of each weight) on CPUs that are not Intel's, ``onednn`` everywhere,
    ``blas`` nowhere. Read once per process. Raises ValueError for another value.
    """
    value = envs.cpu_fp32_prefill_linear()
    if value != "auto":
        return value == "onednn"
    return cpu_vendor() != "GenuineIntel"


def cpu_vendor() -> str:
    """The CPU vendor string (``GenuineIntel``, ``AuthenticAMD``, ...) from /proc/cpuinfo, or ``""``."""
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
    """Whether this CPU has AMX tiles, where oneDNN's bfloat16 math for float32 linears rounds x and
    the weight to bfloat16 and sums in float32 (``Linear.bf16_math``). Warns once where it does not."""
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    if not is_amx and not _warned_no_amx:
        _warned_no_amx.append(True)
        logger.warning("bfloat16 math for float32 linears needs AMX, which this CPU lacks: they stay float32")
    return is_amx


# Below this many rows bfloat16 math is slower than float32 for SmolLM2's shapes (a decode
# batch of a few requests streams the float32 weight either way and the conversion costs more
# than it saves); from 16 rows up it is faster (benchmarks/linear_kernels.py).
BF16_MATH_MIN_ROWS = 16


def _packed_linear_bf16_math(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's packed float32 linear with bfloat16 math allowed for this call only (the
    setting is process-wide in torch; the previous value is restored)."""
    knob = torch.backends.mkldnn.matmul
    previous = knob.fp32_precision
    knob.fp32_precision = "bf16"
    try:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    finally:
        knob.fp32_precision = previous


class MergedLinear(Linear):
    """Projections of the same input stacked on the output axis: one matmul instead of several.

    Args:
        in_features: input size.
        output_sizes: rows of each projection, in order (e.g. ``[q, kv, kv]`` or
            ``[intermediate, intermediate]``).
        bias: whether every projection has a bias.

    ``forward`` returns (T, sum(output_sizes)); split it with ``output_sizes``.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        """The rows of projection ``index`` inside ``param`` (this module's weight or bias), a view."""
        offset = sum(self.output_sizes[:index])
        return param.narrow(0, offset, self.output_sizes[index])


def pack_linears_for_cpu(module: nn.Module, batch_hint: int = 64, bf16_math: bool = False) -> int:
    """Prepack every :class:`Linear` under ``module`` for oneDNN; returns how many were packed.
    ``bf16_math``: see :meth:`Linear.pack_for_cpu`."""
    return sum(m.pack_for_cpu(batch_hint, bf16_math) for m in module.modules() if isinstance(m, Linear))


def packed_copy_bytes(module: nn.Module) -> int:
    """Bytes of the packed weight copies (skinny GEMM and oneDNN) every :class:`Linear` under
    ``module`` holds next to its parameters (memory the parameters' count leaves out)."""
    total = 0
    for m in module.modules():
        if isinstance(m, Linear):
            if m.skinny_weight is not None:
                total += m.skinny_weight.nbytes
            if m.packed_weight is not None:
                total += m.packed_weight.numel() * m.packed_weight.element_size()
    return total


def unpack_linears(module: nn.Module) -> None:
    """Undo :func:`pack_linears_for_cpu`."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.unpack()
