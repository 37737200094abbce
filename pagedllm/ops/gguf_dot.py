"""GGUF block dot products (``native/gguf_dot.c``): ``x @ W.T`` with W in its GGUF block bytes and x quantized
per row to int8 blocks of 32 (:func:`quantize_rows`, once per input, shared by every weight it meets), and the
blocks dequantized to float32 (prefill panels). Each output sums in a fixed order (batch- and thread-invariant).
The path (AVX512-VNNI, AVX2, portable C) is chosen once per process: ``envs.GGUF_DOT_ISA``.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

from pagedllm import envs, native
from pagedllm.ops import recording

__all__ = ["BLOCK_TYPES", "GGUFDotKernel", "QuantizedRows", "check_weight", "dequantize_rows", "dot_rows", "isa", "kernel",
           "load_kernel", "num_threads", "process_isa", "quantize_q8_0", "quantize_rows"]

_SOURCE = native.SOURCE_DIR / "gguf_dot.c"
_ABI_VERSION = 5
# ggml type id -> name; the types gguf_dot.c handles
BLOCK_TYPES = {8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}
ACTIVATION_BLOCK = 32
# Weight elements per thread below which a call runs on the calling thread.
_ELEMENTS_PER_THREAD = 1 << 17
_p, _i, _ssize = ctypes.c_void_p, ctypes.c_int, ctypes.c_ssize_t


class GGUFDotKernel:
    """The loaded library: ``quantize``, ``dot``, ``dequantize``, ``isa_available(isa)``, block sizes per type."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.pagedllm_gguf_dot_abi_version.restype = _i
        if lib.pagedllm_gguf_dot_abi_version() != _ABI_VERSION:
            raise OSError(f"{_SOURCE.name}: ABI version mismatch")
        for name in ("pagedllm_gguf_dot_block_bytes", "pagedllm_gguf_dot_block_weights", "gguf_dot_isa_available"):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = [_i], _i
        self.block_bytes = {t: lib.pagedllm_gguf_dot_block_bytes(t) for t in BLOCK_TYPES}
        self.block_weights = {t: lib.pagedllm_gguf_dot_block_weights(t) for t in BLOCK_TYPES}
        self.isa_available = lib.gguf_dot_isa_available
        self.quantize = lib.gguf_quantize_rows
        self.quantize.argtypes, self.quantize.restype = [_p, _ssize, _i, _i, _i, _p, _p, _p, _p, _i, _i], None
        self.dot = lib.gguf_dot_rows
        self.dot.argtypes = [_i, _p, _ssize, _i, _i, _p, _p, _p, _p, _i, _p, _p, _ssize, _i, _i]
        self.dot.restype = _i
        self.quantize_task = recording.task_pointer(lib, "gguf_quantize_rows_task")
        self.dot_task = recording.task_pointer(lib, "gguf_dot_rows_task")
        self.quantize_q8_0 = lib.gguf_quantize_q8_0
        self.quantize_q8_0.argtypes, self.quantize_q8_0.restype = [_p, _ssize, _i, _i, _p, _i], None
        self.dequantize = lib.gguf_dequantize_rows
        self.dequantize.argtypes, self.dequantize.restype = [_i, _p, _ssize, _i, _i, _p, _ssize, _i], _i
        self.dequantize_isa = lib.gguf_dequantize_rows_isa
        self.dequantize_isa.argtypes = [_i, _p, _ssize, _i, _i, _p, _ssize, _i, _i, _i]
        self.dequantize_isa.restype = _i
        self.unpack = lib.gguf_unpack_rows
        self.unpack.argtypes, self.unpack.restype = [_i, _p, _ssize, _i, _i, _p, _p, _p, _i], _i
        self._lib = lib


_load_lock = threading.Lock()
_kernel: list[GGUFDotKernel | None] = []
_isa: list[int] = []


def load_kernel(extra_flags: tuple[str, ...] = ()) -> GGUFDotKernel | None:
    """The kernels built with ``extra_flags``, or None when they cannot be built or loaded (logged once)."""
    return native.load_kernels(_SOURCE, GGUFDotKernel, "GGUF dot-product kernel", "dequantized tiles", extra_flags)


def kernel() -> GGUFDotKernel | None:
    """This process's kernels (built on first use), or None without a compiler."""
    if not _kernel:
        with _load_lock:
            if not _kernel:
                _kernel.append(load_kernel())
    return _kernel[0]


def process_isa() -> int:
    """:func:`isa` of this process's kernels, read once (the path every call without ``path`` takes)."""
    if not _isa:
        _isa.append(isa())
    return _isa[0]


def isa(k: GGUFDotKernel | None = None) -> int:
    """The path ``envs.GGUF_DOT_ISA`` names, auto = the best this CPU runs. Raises ValueError for a named path
    this CPU cannot run (or a value not in the variable's choices)."""
    k = k or kernel()
    name = envs.gguf_dot_isa()
    if name == "auto":
        return next(v for v in (2, 1, 0) if k.isa_available(v))
    if not k.isa_available(ISAS[name]):
        raise ValueError(f"{envs.GGUF_DOT_ISA.name}={name}: this CPU cannot run that path")
    return ISAS[name]


def num_threads(work: int) -> int:
    """Threads for a call over ``work`` weight elements: torch's count, fewer for small work."""
    if work < 2 * _ELEMENTS_PER_THREAD:
        return 1
    return max(1, min(torch.get_num_threads(), work // _ELEMENTS_PER_THREAD))


@dataclass(frozen=True)
class QuantizedRows:
    """x (M, K) as int8 blocks of 32: ``q`` (M, K) int8, ``d`` (M, K / 32) float32 scales, ``s`` = d * sum(q), and
    ``s16`` (M, K / 16) = d * the sum of each 16 codes."""

    q: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor
    s16: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]


def quantize_rows(x: torch.Tensor, k: GGUFDotKernel | None = None, path: int | None = None) -> QuantizedRows:
    """x (M, K) float32 or bfloat16 on the CPU, rows contiguous, K a multiple of 32 (recorded into an active CPU
    decode graph, :mod:`pagedllm.ops.recording`); ``path`` as :func:`dot_rows` takes it (None: this process's for
    its own kernels, else the best ``k`` runs). Every path writes the same bits. Raises ValueError otherwise."""
    path = (process_isa() if k is None else isa(k)) if path is None else path
    k = k or kernel()
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_cpu or x.stride(1) != 1 \
            or x.shape[1] % ACTIVATION_BLOCK:
        raise ValueError(f"quantize_rows: x must be (M, K) float32/bfloat16 on the CPU with contiguous rows and K a "
                         f"multiple of {ACTIVATION_BLOCK}, got {tuple(x.shape)} {x.dtype} stride {x.stride()}")
    m, n = x.shape
    q = torch.empty(m, n, dtype=torch.int8)
    d = torch.empty(m, n // ACTIVATION_BLOCK)
    s = torch.empty(m, n // ACTIVATION_BLOCK)
    s16 = torch.empty(m, 2 * n // ACTIVATION_BLOCK)
    if m:
        recording.call(k.quantize, x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), m, n, q.data_ptr(),
                       d.data_ptr(), s.data_ptr(), s16.data_ptr(), path, num_threads(m * n // 8),
                       task=(k.quantize_task, recording.TEAM))
    return QuantizedRows(q, d, s, s16)


def check_weight(k: GGUFDotKernel, block_type: int, weight: torch.Tensor, in_features: int) -> None:
    if block_type not in BLOCK_TYPES:
        raise ValueError(f"GGUF block type {block_type} has no kernel (kernels: {sorted(BLOCK_TYPES.values())})")
    per, size = k.block_weights[block_type], k.block_bytes[block_type]
    if in_features % per or weight.dtype != torch.uint8 or weight.dim() != 2 or weight.stride(1) != 1 \
            or weight.shape[1] < in_features // per * size:
        raise ValueError(f"{BLOCK_TYPES[block_type]} weight: in_features {in_features} must be a multiple of {per} and "
                         f"the weight (N, >= {in_features // per * size}) uint8 with contiguous rows, got "
                         f"{tuple(weight.shape)} {weight.dtype}")


def dot_rows(block_type: int, weight: torch.Tensor, x: QuantizedRows, out: torch.Tensor,
             bias: torch.Tensor | None = None, k: GGUFDotKernel | None = None, path: int | None = None) -> None:
    """``out[m, n] = bias[n] + x[m] . W[n]``: weight (N, row bytes) uint8 GGUF blocks of ``block_type`` (a ggml
    type id), out a float32 (M, N) view with contiguous rows (a column slice of a wider output is fine), bias
    float32 (N,) or None. Raises ValueError for shapes or types that do not fit."""
    k = k or kernel()
    check_weight(k, block_type, weight, x.in_features)
    n = weight.shape[0]
    if out.dtype != torch.float32 or out.shape != (x.num_rows, n) or (n > 0 and out.stride(1) != 1):
        raise ValueError(f"dot_rows: out must be float32 ({x.num_rows}, {n}) with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if not x.num_rows or not n:
        return
    rc = k.dot(block_type, weight.data_ptr(), weight.stride(0), n, x.in_features, x.q.data_ptr(), x.d.data_ptr(),
               x.s.data_ptr(), x.s16.data_ptr(), x.num_rows, None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
               process_isa() if path is None else path, num_threads(n * x.in_features))
    if rc == -2:
        raise MemoryError(f"gguf_dot_rows: no memory for the activation scales of {x.num_rows} rows")
    if rc != 0:
        raise ValueError(f"gguf_dot_rows refused {BLOCK_TYPES[block_type]} (path {path})")


def quantize_q8_0(weight: torch.Tensor, k: GGUFDotKernel | None = None) -> torch.Tensor:
    """float32 (N, K) rows (contiguous, K a multiple of 32) as Q8_0 blocks (N, K / 32 * 34) uint8, by gguf's rule: a
    weight dequantized from Q8_0 comes back as the same bytes. Raises ValueError otherwise."""
    k = k or kernel()
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.stride(1) != 1 or weight.shape[1] % 32:
        raise ValueError(f"quantize_q8_0: weight must be float32 (N, K) with contiguous rows and K a multiple of 32, "
                         f"got {tuple(weight.shape)} {weight.dtype}")
    n, in_features = weight.shape
    out = torch.empty(n, in_features // 32 * 34, dtype=torch.uint8)
    if n:
        k.quantize_q8_0(weight.data_ptr(), weight.stride(0), n, in_features, out.data_ptr(),
                        num_threads(n * in_features))
    return out


def dequantize_rows(block_type: int, weight: torch.Tensor, in_features: int, out: torch.Tensor | None = None,
                    k: GGUFDotKernel | None = None, path: int | None = None) -> torch.Tensor:
    """The (N, in_features) values of ``weight``'s blocks, float32, or bfloat16 (rounded to nearest even) when
    ``out`` is bfloat16; written into ``out`` (rows contiguous) if given. ``path``: the ISA whose unpacking runs
    (default this process's); every path gives the same values. Raises ValueError for a shape or dtype that does
    not fit."""
    k = k or kernel()
    check_weight(k, block_type, weight, in_features)
    n = weight.shape[0]
    out = torch.empty(n, in_features) if out is None else out
    if out.dtype not in (torch.float32, torch.bfloat16) or out.shape != (n, in_features) \
            or (n > 0 and out.stride(1) != 1):
        raise ValueError(f"dequantize_rows: out must be float32 or bfloat16 ({n}, {in_features}) with contiguous "
                         f"rows, got {tuple(out.shape)} {out.dtype}")
    if n:
        rc = k.dequantize_isa(block_type, weight.data_ptr(), weight.stride(0), n, in_features, out.data_ptr(),
                              out.stride(0), int(out.dtype == torch.bfloat16),
                              process_isa() if path is None else path, num_threads(n * in_features))
        if rc != 0:
            raise ValueError(f"gguf_dequantize_rows_isa refused {BLOCK_TYPES[block_type]} (path {path})")
    return out
