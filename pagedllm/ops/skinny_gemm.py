"""Skinny GEMM: ``out = x @ weight.T + bias`` for a decode step's few rows from a weight packed once
(:func:`pack`; ``native/skinny_gemm.c`` has the layouts); larger inputs use torch's matmul. Each output
is summed over k in order (batch- and thread-invariant); bfloat16 accumulates in float32, rounded once.
Switch ``envs.SKINNY_GEMM``: ``0`` off, ``1`` the float32 kernel on any CPU, unset on AVX2/AVX-512.
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

# Rows up to which each kernel beats oneDNN's prepacked linear.
MAX_ROWS = 128
MAX_ROWS_BF16 = 64
MAX_ROWS_BF16_DP = 128
_AMX_PANEL, _AMX_K_BLOCK, _AMX_ROW_BLOCK = 32, 32, 16  # skinny_gemm.c's SG_AMX_NR, SG_AMX_KB, tile rows
_DP_PANEL = 48  # skinny_gemm.c's SG_DP_NR
_SOURCE = native.SOURCE_DIR / "skinny_gemm.c"
_ABI_VERSION = 4
PROFILER_EVENT = "pagedllm::skinny_gemm"
_profiling = torch._C._autograd._profiler_enabled
_p, _i, _ssize = ctypes.c_void_p, ctypes.c_int, ctypes.c_ssize_t
_GEMM_ARGS = [_p, _ssize, _p, _p, _p, _ssize, _i, _i, _i, _i]


@dataclass(frozen=True)
class SkinnyWeight:
    """A linear weight (N = out_features, K = in_features) packed for :func:`skinny_linear`, zero past N.
    ``layout``: ``"f32"`` (ceil(N / W), K, W); ``"amx"`` bfloat16 (ceil(N / 32), K / 32, 2, 16, 16, 2);
    ``"bf16_pairs"`` bfloat16 (ceil(N / 48), K / 2, 48, 2). ``bias``: float32 zero-padded, or None."""

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
    """The loaded library: the ``gemm_*`` kernels, ``panel_width``, ``vector_width``, ``amx`` and ``bf16_dp``."""

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
        # task forms (native/native_team.h) by kernel; the AMX kernel has none (its rows are padded in Python)
        self.tasks = {fn.__name__: recording.task_pointer(lib, f"{fn.__name__}_task")
                      for fn in (self.gemm_f32, self.gemm_bf16_dp, self.gemm_bf16_dp_f32out)}
        self._lib = lib


_load_lock = threading.Lock()
_kernel: list[SkinnyGemmKernel | None] = []  # [] until the first load
_enabled: bool | None = None  # None: read envs.SKINNY_GEMM at the next pack()
_forced = False
_AUTO_CPU_CAPABILITIES = ("AVX2", "AVX512")


def load_kernel(extra_flags: tuple[str, ...] = ()) -> SkinnyGemmKernel | None:
    """The kernels built with ``extra_flags``, or None when they cannot be built or loaded (logged once)."""
    return native.load_kernels(_SOURCE, SkinnyGemmKernel, "skinny GEMM kernel", "oneDNN", extra_flags)


def _get_kernel() -> SkinnyGemmKernel | None:
    if not _kernel:
        with _load_lock:
            if not _kernel:
                _kernel.append(load_kernel())
    return _kernel[0]


def enabled(dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`pack` packs weights of ``dtype``. Raises ValueError when ``envs.SKINNY_GEMM`` is not 0, 1 or
    unset."""
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
    """Switch packing on (True: the float32 kernel on any CPU too) or off; None: follow ``envs.SKINNY_GEMM``."""
    global _enabled, _forced
    _enabled, _forced = value, bool(value)


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> SkinnyWeight | None:
    """``weight`` (N, K) and ``bias`` (N,) packed for :func:`skinny_linear`, or None when no kernel applies."""
    if weight.dim() != 2 or weight.device.type != "cpu" or not packs(weight.dtype, weight.shape[1]):
        return None
    if weight.dtype == torch.bfloat16:
        return (pack_panels_bf16 if _get_kernel().amx else pack_panels_bf16_pairs)(weight, bias)
    return pack_panels(weight, bias, _get_kernel().panel_width)


def packs(dtype: torch.dtype, in_features: int) -> bool:
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
    """Bytes of :func:`pack`'s copy of an ``(out_features, in_features)`` weight here (0 where :func:`packs` is
    false)."""
    if not packs(dtype, in_features):
        return 0
    width = _panel_width(dtype)
    padded = -(-out_features // width) * width
    return padded * in_features * (torch.finfo(dtype).bits // 8) + (padded * 4 if bias else 0)


def _padded_bias(bias: torch.Tensor | None, length: int) -> torch.Tensor | None:
    return None if bias is None else F.pad(bias.detach().float(), (0, length - bias.shape[0])).contiguous()


def pack_panels(weight: torch.Tensor, bias: torch.Tensor | None, width: int) -> SkinnyWeight:
    n, k = weight.shape
    panels = -(-n // width)
    with torch.no_grad():
        padded = F.pad(weight.detach(), (0, 0, 0, panels * width - n))
        packed = padded.view(panels, width, k).transpose(1, 2).contiguous()  # (panels, K, W)
    return SkinnyWeight(packed, _padded_bias(bias, panels * width), n, k, MAX_ROWS)


def pack_panels_bf16(weight: torch.Tensor, bias: torch.Tensor | None) -> SkinnyWeight:
    """bfloat16 ``weight`` (N, K) in the AMX kernel's tiles. Raises ValueError unless K is a multiple of 32."""
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
    """bfloat16 ``weight`` (N, K) in the AVX512-BF16 kernel's (k, k + 1) pair panels. Raises ValueError if K is odd."""
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
    return weight.layout == "bf16_pairs"


def skinny_linear(x: torch.Tensor, weight: SkinnyWeight, kernel: SkinnyGemmKernel | None = None,
                  float32_out: bool = False) -> torch.Tensor:
    """``x @ W.T + b``: x (M, K) of ``weight.dtype`` on the CPU, last dim contiguous -> (M, N); ``float32_out``
    (bf16_pairs only): the unrounded float32 sums. Raises ValueError for an x that does not fit, a missing
    bfloat16 kernel, or ``float32_out`` for another layout.
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
        if m % _AMX_ROW_BLOCK:
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
    task_fn = kernel.tasks.get(gemm.__name__)
    task = None if task_fn is None else (task_fn, recording.TEAM)
    if _profiling():
        with torch.profiler.record_function(PROFILER_EVENT):
            recording.call(gemm, *args, keep=(weight,), task=task)
    else:
        recording.call(gemm, *args, keep=(weight,), task=task)
    return out


def _padded_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    """x (M, K) with ``pad`` zero rows appended, a new tensor; recorded too while a pass is recorded."""
    rec = recording.current()
    if rec is None:
        return F.pad(x, (0, 0, 0, pad))
    with rec.allowed():
        padded = x.new_zeros(x.shape[0] + pad, x.shape[1])
        head = padded[:x.shape[0]]
        head.copy_(x)
    source = rec.alias(x)  # does not pin x's pool block
    rec.add_python(lambda: head.copy_(source))
    rec.keep.append(padded)
    return padded
