"""The W8A8 kernel (``native/int8_gemm.c``): float32 rows quantized to int8 inside the kernel per row and group
of the weight's ``activation_group`` k, times a per-channel int8 weight packed once (:func:`pack`), exact int32
sums per group, float rescales (+ bias). Its output is the torch formula in :mod:`pagedllm.quantization.w8a8` bit
for bit, whatever the rows, threads or ISA. The ISA: ``envs.INT8_GEMM_ISA`` (auto = the best this build runs) or
:func:`set_isa`.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm import envs, native
from pagedllm.ops import recording
from pagedllm.ops import kernel_threads

__all__ = ["ISAS", "MAX_ACTIVATION_GROUP", "Int8GemmKernel", "Int8Weight", "check_activation_group", "int8_linear",
           "isa", "load_kernel", "pack", "set_isa", "unpack"]

ISAS = {"scalar": 0, "avx2": 1, "avx512_vnni": 2}  # int8_gemm.c's isa codes
_SOURCE = native.SOURCE_DIR / "int8_gemm.c"
_ABI_VERSION = 2
_K_GROUP = 4  # int8 per int32 lane (int8_gemm.c's I8_KG)
# the widest activation group whose int32 sum cannot overflow: 255 * 127 * group < 2 ** 31
MAX_ACTIVATION_GROUP = 65536
# the rescale is the torch formula's two roundings: no fused multiply-add
_FLAGS = ("-ffp-contract=off",)
PROFILER_EVENT = "pagedllm::int8_gemm"
_p, _i, _ssize = ctypes.c_void_p, ctypes.c_int, ctypes.c_ssize_t


@dataclass(frozen=True)
class Int8Weight:
    """A (N = out_features, K = in_features) int8 weight packed for :func:`int8_linear`: ``panels`` uint8
    (ceil(N / 64), ceil(K / 4), 64, 4) holding q + 128 (128 past N and K); ``scales`` float32 per channel and
    ``bias`` float32 (or None), both zero-padded to the panels; ``activation_group``: k per activation scale
    (in_features: one per row)."""

    panels: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    activation_group: int

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.panels, self.scales, self.bias) if t is not None)


class Int8GemmKernel:
    """The loaded library: ``gemm`` (int8_gemm_f32), ``panel_width``, ``best_isa`` (an :data:`ISAS` value)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.pagedllm_int8_gemm_abi_version.restype = _i
        if lib.pagedllm_int8_gemm_abi_version() != _ABI_VERSION:
            raise OSError(f"{_SOURCE.name}: ABI version mismatch")
        lib.pagedllm_int8_gemm_panel_width.restype = _i
        lib.pagedllm_int8_gemm_best_isa.restype = _i
        self.panel_width: int = lib.pagedllm_int8_gemm_panel_width()
        self.best_isa: int = lib.pagedllm_int8_gemm_best_isa()
        self.gemm = lib.int8_gemm_f32
        self.gemm.argtypes = [_p, _ssize, _p, _p, _p, _p, _ssize, _i, _i, _i, _i, _i, _i]
        self.gemm.restype = _i
        self.gemm_task = recording.task_pointer(lib, "int8_gemm_f32_task")
        self._lib = lib


_load_lock = threading.Lock()
_kernel: list[Int8GemmKernel | None] = []
_isa: list[int] = []  # [] until first asked: envs.INT8_GEMM_ISA


def load_kernel(extra_flags: tuple[str, ...] = ()) -> Int8GemmKernel | None:
    """The kernel (built once per process; ``extra_flags``: another build, e.g. ``-march=haswell``), or None
    when it cannot be built or loaded (logged once)."""
    if extra_flags:
        return native.load_kernels(_SOURCE, Int8GemmKernel, "int8 GEMM kernel", "the torch formula",
                                   _FLAGS + tuple(extra_flags))
    if not _kernel:
        with _load_lock:
            if not _kernel:
                _kernel.append(native.load_kernels(_SOURCE, Int8GemmKernel, "int8 GEMM kernel",
                                                   "the torch formula", _FLAGS))
    return _kernel[0]


def isa() -> int:
    """The ISA code calls use: ``envs.INT8_GEMM_ISA``'s (auto: the build's best). Raises ValueError naming the
    variable for an ISA this build cannot run, RuntimeError without a kernel."""
    if not _isa:
        set_isa(envs.int8_gemm_isa())
    return _isa[0]


def set_isa(name: str | None) -> None:
    """Force ``name`` (an :data:`ISAS` key or ``"auto"``); None: follow ``envs.INT8_GEMM_ISA`` again.
    Raises ValueError for an unknown name or one above what this build runs."""
    _isa.clear()
    if name is None:
        return
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("the int8 GEMM kernel is not available (no C compiler?)")
    if name == "auto":
        _isa.append(kernel.best_isa)
        return
    if name not in ISAS:
        raise ValueError(f"{envs.INT8_GEMM_ISA.name} must be one of auto, {', '.join(ISAS)}, got {name!r}")
    if ISAS[name] > kernel.best_isa:
        best = next(k for k, v in ISAS.items() if v == kernel.best_isa)
        raise ValueError(f"{envs.INT8_GEMM_ISA.name}={name} is not available on this CPU/build (best: {best})")
    _isa.append(ISAS[name])


def check_activation_group(group: int | None) -> None:
    """Raises ValueError unless ``group`` is None (one scale per row) or a positive int multiple of 4."""
    if group is not None and (not isinstance(group, int) or isinstance(group, bool) or group <= 0
                              or group % _K_GROUP):
        raise ValueError(f"activation_group must be a positive multiple of {_K_GROUP} or None, got {group!r}")


def pack(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, activation_group: int | None = None,
         width: int = 64) -> Int8Weight:
    """q (N, K) int8 (-128 allowed, a checkpoint's symmetric int8) and scales (N,) float32 (and bias (N,)) in the
    kernel's layout; ``activation_group`` k per activation scale (None: K, one per row). Raises ValueError for a q
    that is not int8 with K > 0, scales or a bias of another length, a group that is not a positive multiple of 4,
    or a group (K, for one per row) above :data:`MAX_ACTIVATION_GROUP`."""
    if q.dim() != 2 or q.dtype != torch.int8 or q.shape[1] == 0:
        raise ValueError(f"pack: q must be (out_features, in_features > 0) int8, got {tuple(q.shape)} {q.dtype}")
    n, k = q.shape
    if scales.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"pack: scales and bias must be ({n},), got {tuple(scales.shape)} and "
                         f"{None if bias is None else tuple(bias.shape)}")
    check_activation_group(activation_group)
    # one group per row: K rounded up to the kernel's k groups (the zero padding past K changes no sum)
    group = -(-k // _K_GROUP) * _K_GROUP if activation_group is None or activation_group >= k else activation_group
    if group > MAX_ACTIVATION_GROUP:
        raise ValueError(f"activation_group {group} (in_features {k} with one scale per row) is above "
                         f"{MAX_ACTIVATION_GROUP}: a group's int32 sum could overflow")
    num_panels, k_pad = -(-n // width), -(-k // _K_GROUP) * _K_GROUP
    padded = F.pad(q, (0, k_pad - k, 0, num_panels * width - n)).to(torch.int16).add_(128).to(torch.uint8)
    # (panel, column, k group, 4) -> (panel, k group, column, 4)
    panels = padded.view(num_panels, width, k_pad // _K_GROUP, _K_GROUP).transpose(1, 2).contiguous()
    pad_n = num_panels * width - n
    scales = F.pad(scales.float(), (0, pad_n)).contiguous()
    bias = None if bias is None else F.pad(bias.detach().float(), (0, pad_n)).contiguous()
    return Int8Weight(panels, scales, bias, n, k, group)


def unpack(weight: Int8Weight) -> torch.Tensor:
    """The (N, K) int8 weight :func:`pack` was given."""
    num_panels, groups, width, _ = weight.panels.shape
    q = weight.panels.transpose(1, 2).reshape(num_panels * width, groups * _K_GROUP).to(torch.int16).sub_(128)
    return q[:weight.out_features, :weight.in_features].to(torch.int8).contiguous()


def int8_linear(x: torch.Tensor, weight: Int8Weight, kernel: Int8GemmKernel | None = None,
                isa_code: int | None = None) -> torch.Tensor:
    """x (M, K) float32 on the CPU, rows contiguous -> (M, N) float32 (:mod:`pagedllm.quantization.w8a8`'s
    formula) on :func:`kernel_threads.num_threads` threads; recorded into an active CPU decode graph
    (:mod:`pagedllm.ops.recording`). Raises ValueError
    for an x that does not fit or an ISA the kernel refuses."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != weight.in_features or x.stride(1) != 1 \
            or not x.is_cpu:
        raise ValueError(f"int8_linear: x must be (M, {weight.in_features}) float32 on the CPU with contiguous "
                         f"rows, got {tuple(x.shape)} {x.dtype} stride {x.stride()} on {x.device}")
    kernel = kernel or load_kernel()
    code = isa() if isa_code is None else isa_code
    m = x.shape[0]
    out = torch.empty(m, weight.out_features, dtype=torch.float32)
    bias = weight.bias
    args = (x.data_ptr(), x.stride(0), weight.panels.data_ptr(), weight.scales.data_ptr(),
            None if bias is None else bias.data_ptr(), out.data_ptr(), weight.out_features, m, weight.out_features,
            weight.in_features, weight.activation_group, code,
            kernel_threads.num_threads(m, weight.out_features, weight.in_features))
    task = (kernel.gemm_task, kernel_threads.num_threads(m, weight.out_features, weight.in_features, spinning=True))
    if torch._C._autograd._profiler_enabled():
        with torch.profiler.record_function(PROFILER_EVENT):
            rc = recording.call(kernel.gemm, *args, keep=(weight,), task=task)
    else:
        rc = recording.call(kernel.gemm, *args, keep=(weight,), task=task)
    if rc != 0:
        raise ValueError(f"int8_linear: the kernel refused ISA {code} (best here: {kernel.best_isa}), activation "
                         f"group {weight.activation_group}, or could not allocate its scratch rows")
    return out
