"""Skinny GEMM: the float32 linear layers of a decode step (few rows) in the engine's own C kernel.

``out = x @ weight.T + bias`` for ``x`` of at most :data:`MAX_ROWS` rows, from a copy of the weight
packed once (:func:`pack`) into column panels that one thread streams front to back
(``skinny_gemm.c`` explains the layout and why). Above :data:`MAX_ROWS` rows (prefill chunks) the
caller uses torch's matmul.

Numerics: float32 throughout; each output element is summed over ``k`` in order with fused
multiply-adds, so a row's result does not depend on the batch it rides in or the thread count
(batch-invariant). It differs from oneDNN's/MKL's float32 result in the last bits (their summation
order depends on M), as those differ from each other.

Switch: ``PAGEDLLM_SKINNY_GEMM`` in the environment (read at the first :func:`pack`), or
:func:`set_enabled`: ``0`` keeps the weights for oneDNN instead (``Linear.pack_for_cpu``), ``1``
uses the kernel on any CPU, unset uses it where its build has 16-lane vectors (AVX-512F), the
hosts it was measured faster on; on AVX2-only hosts it is correct but not measured against
oneDNN. The kernel is also skipped when the C library cannot be built (one warning).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm import native

logger = logging.getLogger(__name__)

__all__ = ["MAX_ROWS", "SKINNY_GEMM_ENV", "SkinnyGemmKernel", "SkinnyWeight", "enabled", "load_kernel", "pack", "pack_panels", "set_enabled",
           "skinny_linear"]

SKINNY_GEMM_ENV = "PAGEDLLM_SKINNY_GEMM"
# Rows up to which the kernel beats oneDNN's packed float32 linear on SmolLM2's projections with
# the weights streamed from memory (benchmarks/skinny_gemm.py); above, torch's matmul is used.
MAX_ROWS = 128
_SOURCE = Path(__file__).with_name("skinny_gemm.c")
_ABI_VERSION = 1
# The kernel runs outside torch's operators: under torch's profiler each call is recorded as a range
# of this name, so profiles count it as a matmul (benchmarks/step_profile.py, long_context.py).
PROFILER_EVENT = "pagedllm::skinny_gemm"
_profiling = torch._C._autograd._profiler_enabled
_p, _i, _ssize = ctypes.c_void_p, ctypes.c_int, ctypes.c_ssize_t
# skinny_gemm_f32(x, x_stride, packed, bias, out, out_stride, M, N, K, num_threads)
_GEMM_ARGS = [_p, _ssize, _p, _p, _p, _ssize, _i, _i, _i, _i]


@dataclass(frozen=True)
class SkinnyWeight:
    """A linear weight packed for :func:`skinny_linear`.

    Attributes:
        panels: (ceil(N / W), K, W) float32, contiguous: W consecutive output columns per panel,
            zero past N (W: the kernel's panel width, 48 with AVX-512, 24 without).
        bias: (ceil(N / W) * W,) float32 zero-padded, or None.
        out_features: N. in_features: K.
    """

    panels: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes held (the packed weight is a second copy next to the layer's own)."""
        return self.panels.nbytes + (self.bias.nbytes if self.bias is not None else 0)


class SkinnyGemmKernel:
    """The loaded C library: ``gemm_f32`` (ctypes, releases the GIL), its ``panel_width``
    (output columns per packed panel) and ``vector_width`` (float32 lanes of the build)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.pagedllm_skinny_gemm_abi_version.restype = _i
        if lib.pagedllm_skinny_gemm_abi_version() != _ABI_VERSION:
            raise OSError(f"{_SOURCE.name}: ABI version mismatch")
        lib.pagedllm_skinny_gemm_panel_width.restype = _i
        lib.pagedllm_skinny_gemm_vector_width.restype = _i
        self.panel_width: int = lib.pagedllm_skinny_gemm_panel_width()
        self.vector_width: int = lib.pagedllm_skinny_gemm_vector_width()
        self.gemm_f32 = lib.skinny_gemm_f32
        self.gemm_f32.argtypes, self.gemm_f32.restype = _GEMM_ARGS, None
        self._lib = lib  # keep the library loaded


_load_lock = threading.Lock()
_kernel: list[SkinnyGemmKernel | None] = []  # [] until the first load, then [kernel or None]
_enabled: bool | None = None  # None: read SKINNY_GEMM_ENV at the next pack(); unset there: auto
_AUTO_VECTOR_WIDTH = 16  # lanes of the builds it is on by default for (AVX-512F)


def load_kernel(extra_flags: tuple[str, ...] = ()) -> SkinnyGemmKernel | None:
    """The kernel built with ``extra_flags`` after the native ones (e.g. ``("-march=haswell",)``
    for the AVX2 build), or None when it cannot be built or loaded (logged once)."""
    lib = native.load_library(_SOURCE, extra_flags, what="skinny GEMM kernel (pagedllm/ops)")
    if lib is None:
        return None
    try:
        return SkinnyGemmKernel(lib)
    except (OSError, AttributeError) as e:
        logger.warning("skinny GEMM kernel unavailable (%s); using oneDNN", e)
        return None


def _get_kernel() -> SkinnyGemmKernel | None:
    if not _kernel:
        with _load_lock:
            if not _kernel:
                _kernel.append(load_kernel())
    return _kernel[0]


def enabled() -> bool:
    """Whether :func:`pack` packs: the switch (see the module docstring) and a kernel that builds
    and loads."""
    global _enabled
    if _enabled is None:
        value = os.environ.get(SKINNY_GEMM_ENV, "").strip()
        if value not in ("", "0", "1"):
            raise ValueError(f"{SKINNY_GEMM_ENV} must be 0, 1 or unset, got {value!r}")
        if value == "":
            kernel = _get_kernel()
            _enabled = kernel is not None and kernel.vector_width >= _AUTO_VECTOR_WIDTH
        else:
            _enabled = value == "1"
    return _enabled and _get_kernel() is not None


def set_enabled(value: bool | None) -> None:
    """Switch packing on (True: on any CPU) or off for this process (layers packed before keep
    their packing: pack them again); None: follow ``PAGEDLLM_SKINNY_GEMM`` again."""
    global _enabled
    _enabled = value


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> SkinnyWeight | None:
    """``weight`` (N, K) and ``bias`` (N,) packed for :func:`skinny_linear`, or None when the kernel
    does not apply: not 2-D float32 on the CPU, or :func:`enabled` false. The packed copy has no
    autograd link to ``weight`` (inference only; ``Linear.forward`` keeps grad-tracked inputs on
    ``F.linear``)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu" or not enabled():
        return None
    return pack_panels(weight, bias, _get_kernel().panel_width)


def pack_panels(weight: torch.Tensor, bias: torch.Tensor | None, width: int) -> SkinnyWeight:
    """``weight`` (N, K) float32 and ``bias`` (N,) in panels of ``width`` columns (the layout
    ``skinny_gemm.c`` reads; :func:`pack` uses the loaded kernel's width)."""
    n, k = weight.shape
    panels = -(-n // width)
    with torch.no_grad():
        padded = F.pad(weight.detach(), (0, 0, 0, panels * width - n))  # (panels * W, K)
        packed = padded.view(panels, width, k).transpose(1, 2).contiguous()  # (panels, K, W)
        packed_bias = None if bias is None else F.pad(bias.detach().float(), (0, panels * width - n)).contiguous()
    return SkinnyWeight(packed, packed_bias, n, k)


def skinny_linear(x: torch.Tensor, weight: SkinnyWeight, kernel: "SkinnyGemmKernel | None" = None) -> torch.Tensor:
    """``x @ W.T + b`` for the packed ``weight``: x (M, K) float32 on the CPU, M >= 0, last dim
    contiguous -> (M, N) float32, new tensor. ``kernel``: the loaded one by default (tests pass
    another build).

    Raises:
        ValueError: x is not 2-D float32 with ``weight.in_features`` columns and unit column stride.
    """
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != weight.in_features or x.stride(1) != 1 \
            or not x.is_cpu:
        raise ValueError(f"skinny_linear: x must be (M, {weight.in_features}) float32 on the CPU with contiguous "
                         f"rows, got {tuple(x.shape)} {x.dtype} stride {x.stride()} on {x.device}")
    m = x.shape[0]
    out = torch.empty(m, weight.out_features, dtype=torch.float32)
    if m:
        bias = weight.bias
        args = (x.data_ptr(), x.stride(0), weight.panels.data_ptr(), None if bias is None else bias.data_ptr(),
                out.data_ptr(), weight.out_features, m, weight.out_features, weight.in_features,
                torch.get_num_threads())
        gemm = (kernel or _kernel[0]).gemm_f32
        if _profiling():
            with torch.profiler.record_function(PROFILER_EVENT):
                gemm(*args)
        else:
            gemm(*args)
    return out
