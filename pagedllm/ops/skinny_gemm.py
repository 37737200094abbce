"""Skinny GEMM: ``out = x @ weight.T + bias`` for a decode step's few rows (at most
``SkinnyWeight.max_rows``) from a copy of the weight packed once (:func:`pack`) into column panels
(``native/skinny_gemm.c`` has the layouts); larger inputs use torch's matmul. Kernels: float32 FMAs
(:data:`MAX_ROWS`), bfloat16 on AMX tiles (:data:`MAX_ROWS_BF16`, K a multiple of 32; Linux grants
the tile state on request, asked when the library loads) or AVX512-BF16 ``vdpbf16ps`` pairs
(:data:`MAX_ROWS_BF16_DP`, K even). Each output element is summed over k in order (batch- and
thread-invariant); bfloat16 accumulates in float32 and rounds once at the end, as torch does.

Switch: ``envs.SKINNY_GEMM`` (read at the first :func:`pack`) or :func:`set_enabled`: ``0`` leaves
the weights to oneDNN, ``1`` uses the float32 kernel on any CPU, unset on CPUs with AVX2 or AVX-512;
the bfloat16 kernels run wherever they build unless it is ``0``.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm import envs, native
from pagedllm.ops import recording

__all__ = ["MAX_ROWS", "MAX_ROWS_BF16", "MAX_ROWS_BF16_DP", "SkinnyGemmKernel", "SkinnyWeight",
           "enabled", "load_kernel", "pack", "pack_panels", "pack_panels_bf16", "pack_panels_bf16_pairs",
           "packed_nbytes", "packs", "set_enabled", "skinny_linear", "supports_float32_out"]

# Rows up to which each kernel beats oneDNN's prepacked linear (benchmarks/skinny_gemm.py).
MAX_ROWS = 128
MAX_ROWS_BF16 = 64
MAX_ROWS_BF16_DP = 128
_AMX_PANEL, _AMX_K_BLOCK, _AMX_ROW_BLOCK = 32, 32, 16  # skinny_gemm.c's SG_AMX_NR, SG_AMX_KB, tile rows
_DP_PANEL = 48  # skinny_gemm.c's SG_DP_NR
_SOURCE = native.SOURCE_DIR / "skinny_gemm.c"
_ABI_VERSION = 4
# Under torch's profiler each call is a range of this name, so profiles count it as a matmul.
PROFILER_EVENT = "pagedllm::skinny_gemm"
_profiling = torch._C._autograd._profiler_enabled
_p, _i, _ssize = ctypes.c_void_p, ctypes.c_int, ctypes.c_ssize_t
# skinny_gemm_f32 / skinny_gemm_bf16_amx / skinny_gemm_bf16_dp(x, x_stride, packed, bias, out, out_stride, M, N, K, num_threads)
_GEMM_ARGS = [_p, _ssize, _p, _p, _p, _ssize, _i, _i, _i, _i]


@dataclass(frozen=True)
class SkinnyWeight:
    """A linear weight (N = out_features, K = in_features) packed for :func:`skinny_linear`, contiguous,
    zero past N. ``layout`` says which kernel reads ``panels``: ``"f32"`` (ceil(N / W), K, W) with W the
    kernel's panel width; ``"amx"`` bfloat16 (ceil(N / 32), K / 32, 2, 16, 16, 2) tiles; ``"bf16_pairs"``
    bfloat16 (ceil(N / 48), K / 2, 48, 2). ``bias``: float32 zero-padded, or None. ``max_rows``: the
    most rows :class:`~pagedllm.models.layers.linear.Linear` sends it."""

    panels: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    max_rows: int
    layout: str = "f32"

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes + (self.bias.nbytes if self.bias is not None else 0)


class SkinnyGemmKernel:
    """The loaded library: the ``gemm_*`` kernels (ctypes; ``gemm_bf16_dp_f32out`` leaves the sums in
    float32), ``panel_width`` and ``vector_width`` of the float32 kernel, ``amx`` (the tile state was
    granted) and ``bf16_dp`` (the build has the AVX512-BF16 kernel)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.pagedllm_skinny_gemm_abi_version.restype = _i
        if lib.pagedllm_skinny_gemm_abi_version() != _ABI_VERSION:
            raise OSError(f"{_SOURCE.name}: ABI version mismatch")
        for name in ("panel_width", "vector_width", "amx_init", "bf16_dp_available"):
            getattr(lib, f"pagedllm_skinny_gemm_{name}").restype = _i
        self.panel_width: int = lib.pagedllm_skinny_gemm_panel_width()
        self.vector_width: int = lib.pagedllm_skinny_gemm_vector_width()
        self.amx: bool = lib.pagedllm_skinny_gemm_amx_init() == 1
        self.bf16_dp: bool = lib.pagedllm_skinny_gemm_bf16_dp_available() == 1
        self.gemm_f32 = lib.skinny_gemm_f32
        self.gemm_f32.argtypes, self.gemm_f32.restype = _GEMM_ARGS, None
        self.gemm_bf16_amx = lib.skinny_gemm_bf16_amx
        self.gemm_bf16_amx.argtypes, self.gemm_bf16_amx.restype = _GEMM_ARGS, _i
        self.gemm_bf16_dp = lib.skinny_gemm_bf16_dp
        self.gemm_bf16_dp.argtypes, self.gemm_bf16_dp.restype = _GEMM_ARGS, _i
        self.gemm_bf16_dp_f32out = lib.skinny_gemm_bf16_dp_f32out
        self.gemm_bf16_dp_f32out.argtypes, self.gemm_bf16_dp_f32out.restype = _GEMM_ARGS, _i
        self._lib = lib  # keep the library loaded


_load_lock = threading.Lock()
_kernel: list[SkinnyGemmKernel | None] = []  # [] until the first load, then [kernel or None]
_enabled: bool | None = None  # None: read envs.SKINNY_GEMM at the next pack()
_forced = False  # the switch says 1: the float32 kernel on any CPU
# CPUs the float32 kernel is on by default for: FMA vectors (torch's dispatch level), where it beats oneDNN
_AUTO_CPU_CAPABILITIES = ("AVX2", "AVX512")


def load_kernel(extra_flags: tuple[str, ...] = ()) -> SkinnyGemmKernel | None:
    """The kernels built with ``extra_flags`` after the native ones (e.g. ``("-march=haswell",)``
    for the AVX2 build), or None when they cannot be built or loaded (logged once)."""
    return native.load_kernels(_SOURCE, SkinnyGemmKernel, "skinny GEMM kernel", "oneDNN", extra_flags)


def _get_kernel() -> SkinnyGemmKernel | None:
    if not _kernel:
        with _load_lock:
            if not _kernel:
                _kernel.append(load_kernel())
    return _kernel[0]


def enabled(dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`pack` packs weights of ``dtype``: the switch (see the module docstring) and a
    kernel that builds, loads and (bfloat16) has AMX or AVX512-BF16.

    Raises ValueError (``envs.read``) when ``envs.SKINNY_GEMM`` is not 0, 1 or unset.
    """
    global _enabled, _forced
    if _enabled is None:
        switch = envs.skinny_gemm()
        _enabled, _forced = switch is not False, switch is True
    kernel = _get_kernel() if _enabled else None
    if kernel is None:
        return False
    if dtype == torch.bfloat16:
        return kernel.amx or kernel.bf16_dp
    return dtype == torch.float32 and (_forced or torch.backends.cpu.get_cpu_capability() in _AUTO_CPU_CAPABILITIES)


def set_enabled(value: bool | None) -> None:
    """Switch packing on (True: the float32 kernel on any CPU too) or off for this process (layers
    packed before keep their packing: pack them again); None: follow ``envs.SKINNY_GEMM`` again."""
    global _enabled, _forced
    _enabled, _forced = value, bool(value)


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> SkinnyWeight | None:
    """``weight`` (N, K) and ``bias`` (N,) packed for :func:`skinny_linear`, or None when no kernel
    applies: not 2-D float32/bfloat16 on the CPU, :func:`enabled` false for its dtype, or a
    bfloat16 K that the kernel cannot take (AMX: a multiple of 32; AVX512-BF16: even). The packed copy has no autograd link to ``weight``
    (inference only; ``Linear.forward`` keeps grad-tracked inputs on ``F.linear``)."""
    if weight.dim() != 2 or weight.device.type != "cpu" or not packs(weight.dtype, weight.shape[1]):
        return None
    if weight.dtype == torch.bfloat16:
        return (pack_panels_bf16 if _get_kernel().amx else pack_panels_bf16_pairs)(weight, bias)
    return pack_panels(weight, bias, _get_kernel().panel_width)


def packs(dtype: torch.dtype, in_features: int) -> bool:
    """Whether :func:`pack` packs a CPU weight of ``dtype`` with ``in_features`` columns: :func:`enabled`
    for the dtype, and a K the kernel takes (bfloat16: a multiple of 32 for AMX, even without it)."""
    if not enabled(dtype):
        return False
    if dtype == torch.bfloat16:
        return in_features % (_AMX_K_BLOCK if _get_kernel().amx else 2) == 0
    return True


def _panel_width(dtype: torch.dtype) -> int:
    if dtype == torch.bfloat16:
        return _AMX_PANEL if _get_kernel().amx else _DP_PANEL
    return _get_kernel().panel_width


def packed_nbytes(out_features: int, in_features: int, dtype: torch.dtype, bias: bool = False) -> int:
    """Bytes of :func:`pack`'s copy of an ``(out_features, in_features)`` weight of ``dtype`` (with a
    bias or not) on this host, 0 where :func:`packs` is false: N padded to the kernel's panel width,
    the bias padded and in float32 (:attr:`SkinnyWeight.nbytes` of the packed result)."""
    if not packs(dtype, in_features):
        return 0
    width = _panel_width(dtype)
    padded = -(-out_features // width) * width
    return padded * in_features * (torch.finfo(dtype).bits // 8) + (padded * 4 if bias else 0)


def _padded_bias(bias: torch.Tensor | None, length: int) -> torch.Tensor | None:
    return None if bias is None else F.pad(bias.detach().float(), (0, length - bias.shape[0])).contiguous()


def pack_panels(weight: torch.Tensor, bias: torch.Tensor | None, width: int) -> SkinnyWeight:
    """float32 ``weight`` (N, K) and ``bias`` (N,) in panels of ``width`` columns (the layout
    ``skinny_gemm.c``'s float32 kernel reads; :func:`pack` uses the loaded kernel's width)."""
    n, k = weight.shape
    panels = -(-n // width)
    with torch.no_grad():
        padded = F.pad(weight.detach(), (0, 0, 0, panels * width - n))  # (panels * W, K)
        packed = padded.view(panels, width, k).transpose(1, 2).contiguous()  # (panels, K, W)
    return SkinnyWeight(packed, _padded_bias(bias, panels * width), n, k, MAX_ROWS)


def pack_panels_bf16(weight: torch.Tensor, bias: torch.Tensor | None) -> SkinnyWeight:
    """bfloat16 ``weight`` (N, K), K a multiple of 32, in the AMX kernel's tiles: for each panel of
    32 columns and block of 32 k, two 16 x 16 tiles of (k, k + 1) pairs (``skinny_gemm.c``).

    Raises:
        ValueError: K is not a multiple of 32.
    """
    n, k = weight.shape
    if k % _AMX_K_BLOCK:
        raise ValueError(f"pack_panels_bf16: in_features must be a multiple of {_AMX_K_BLOCK}, got {k}")
    panels = -(-n // _AMX_PANEL)
    with torch.no_grad():
        padded = F.pad(weight.detach(), (0, 0, 0, panels * _AMX_PANEL - n))
        # (panel, tile, column, k block, pair row, pair) -> (panel, k block, tile, pair row, column, pair)
        packed = padded.view(panels, 2, 16, k // _AMX_K_BLOCK, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
    return SkinnyWeight(packed, _padded_bias(bias, panels * _AMX_PANEL), n, k, MAX_ROWS_BF16, "amx")


def pack_panels_bf16_pairs(weight: torch.Tensor, bias: torch.Tensor | None) -> SkinnyWeight:
    """bfloat16 ``weight`` (N, K), K even, in the AVX512-BF16 kernel's panels: 48 output columns per
    panel, K / 2 rows of 48 (k, k + 1) pairs (``skinny_gemm.c``).

    Raises:
        ValueError: K is odd.
    """
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"pack_panels_bf16_pairs: in_features must be even, got {k}")
    panels = -(-n // _DP_PANEL)
    with torch.no_grad():
        padded = F.pad(weight.detach(), (0, 0, 0, panels * _DP_PANEL - n))
        # (panel, column, k pair, pair) -> (panel, k pair, column, pair)
        packed = padded.view(panels, _DP_PANEL, k // 2, 2).transpose(1, 2).contiguous()
    return SkinnyWeight(packed, _padded_bias(bias, panels * _DP_PANEL), n, k, MAX_ROWS_BF16_DP, "bf16_pairs")


def supports_float32_out(weight: SkinnyWeight) -> bool:
    """Whether :func:`skinny_linear` can return ``weight``'s sums unrounded in float32 for bfloat16 x
    (``float32_out=True``): the AVX512-BF16 kernel's layout."""
    return weight.layout == "bf16_pairs"


def skinny_linear(x: torch.Tensor, weight: SkinnyWeight, kernel: SkinnyGemmKernel | None = None,
                  float32_out: bool = False) -> torch.Tensor:
    """``x @ W.T + b`` for the packed ``weight``: x (M, K) of ``weight.dtype`` on the CPU, M >= 0,
    last dim contiguous -> (M, N) of the same dtype, new tensor; with ``float32_out`` (bfloat16
    pairs weights only, see :func:`supports_float32_out`) the float32 sums, not rounded to bfloat16 (the
    LM head's logits). ``kernel``: the loaded one by default (tests pass another build).

    Raises:
        ValueError: x is not 2-D of the weight's dtype with ``weight.in_features`` columns and unit
            column stride; or a bfloat16 weight whose kernel ``kernel`` lacks (AMX, AVX512-BF16);
            or ``float32_out`` for a weight of another layout.
    """
    if x.dim() != 2 or x.dtype != weight.dtype or x.shape[1] != weight.in_features or x.stride(1) != 1 \
            or not x.is_cpu:
        raise ValueError(f"skinny_linear: x must be (M, {weight.in_features}) {weight.dtype} on the CPU with "
                         f"contiguous rows, got {tuple(x.shape)} {x.dtype} stride {x.stride()} on {x.device}")
    if float32_out and weight.layout != "bf16_pairs":
        raise ValueError(f"skinny_linear: float32_out needs a bfloat16 pairs weight, got the {weight.layout} layout")
    kernel = kernel or _kernel[0]
    m = x.shape[0]
    out = torch.empty(m, weight.out_features, dtype=torch.float32 if float32_out else x.dtype)
    if not m:
        return out
    if weight.layout == "amx":
        if not kernel.amx:
            raise ValueError("skinny_linear: a bfloat16 weight needs the AMX kernel, not granted here")
        gemm = kernel.gemm_bf16_amx
        if m % _AMX_ROW_BLOCK:  # the kernel loads x in tiles of 16 rows
            x = _padded_rows(x, _AMX_ROW_BLOCK - m % _AMX_ROW_BLOCK)
    elif weight.layout == "bf16_pairs":
        if not kernel.bf16_dp:
            raise ValueError("skinny_linear: a bfloat16 pairs weight needs the AVX512-BF16 kernel, not built here")
        gemm = kernel.gemm_bf16_dp_f32out if float32_out else kernel.gemm_bf16_dp
    else:
        gemm = kernel.gemm_f32
    bias = weight.bias
    args = (x.data_ptr(), x.stride(0), weight.panels.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), weight.out_features, m, weight.out_features, weight.in_features,
            torch.get_num_threads())
    if _profiling():
        with torch.profiler.record_function(PROFILER_EVENT):
            recording.call(gemm, *args, keep=(weight,))
    else:
        recording.call(gemm, *args, keep=(weight,))
    return out


def _padded_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    """x (M, K) with ``pad`` zero rows appended, a new tensor. While a pass is recorded
    (:mod:`pagedllm.ops.recording`) the copy of x's rows is recorded too: the padding rows are
    zero once and stay so."""
    rec = recording.current()
    if rec is None:
        return F.pad(x, (0, 0, 0, pad))
    with rec.allowed():
        padded = x.new_zeros(x.shape[0] + pad, x.shape[1])
        head = padded[:x.shape[0]]
        head.copy_(x)
    source = rec.alias(x)  # does not pin x's pool block (read here, before later calls reuse it)
    rec.add_python(lambda: head.copy_(source))
    rec.keep.append(padded)
    return padded
