"""Weights repacked for the AVX512-VNNI GEMM (``native/gguf_repack.c``): unsigned codes with a scale and a min per
group of k (``w = scale * code + min``) laid out in tiles of 16 outputs, so that one vpdpbusd dots 4 k of 16 outputs
with one activation row. A GGUF layer's blocks are unpacked once at load (``gguf_unpack_rows``: a scale and min per
16) by :func:`repack`; int4's groups and any other codes with their scales go through :func:`repack_codes`.
Activations are :func:`gguf_dot.quantize_rows`'s int8 blocks of 32. Each output sums in a fixed order (batch- and
thread-invariant). 4-bit codes stay 4-bit (Q4_0, Q4_1, Q4_K, int4); the others (Q5_*, Q6_K, Q8_0) one byte each.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from dataclasses import dataclass

import torch

from pagedllm import native
from pagedllm.ops import gguf_dot, recording
from pagedllm.ops.kernel_threads import num_threads

__all__ = ["RepackedWeight", "available", "concat_rows", "dot", "kernel", "linear", "repack", "repack_codes", "values"]

_SOURCE = native.SOURCE_DIR / "gguf_repack.c"
_ABI_VERSION = 4
# ggml types whose codes fit 4 bits (Q4_0, Q4_1, Q4_K) and whose scale changes every 16 codes (Q6_K)
_FOUR_BIT = {2, 3, 12}
_SUB16 = {14}
_TILE = 16  # outputs per tile (GR_NR)
_p, _i, _ssize = ctypes.c_void_p, ctypes.c_int, ctypes.c_ssize_t


class GGUFRepackKernel:
    """The loaded library: ``repack``, ``values``, ``dot``, ``available()`` and the layout's sizes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.pagedllm_gguf_repack_abi_version.restype = _i
        if lib.pagedllm_gguf_repack_abi_version() != _ABI_VERSION:
            raise OSError(f"{_SOURCE.name}: ABI version mismatch")
        lib.gguf_repack_available.restype = _i
        self.available = bool(lib.gguf_repack_available())
        self.code_bytes = lib.gguf_repack_code_bytes
        self.code_bytes.argtypes, self.code_bytes.restype = [_i, _i, _i, _i], _ssize
        self.scale_count = lib.gguf_repack_scale_count
        self.scale_count.argtypes, self.scale_count.restype = [_i, _i, _i], _ssize
        self.repack = lib.gguf_repack
        self.repack.argtypes, self.repack.restype = [_p, _p, _p, _i, _i, _i, _i, _i, _i, _p, _p, _p, _i], _i
        self.values = lib.gguf_repack_values
        self.values.argtypes = [_p, _p, _p, _i, _i, _i, _i, _i, _i, _p, _i, _p, _ssize, _i, _i]
        self.values.restype = _i
        self.dot = lib.gguf_repack_dot
        self.dot.argtypes = [_p, _p, _p, _i, _i, _i, _i, _i, _i, _p, _p, _p, _p, _i, _p, _p, _ssize, _i]
        self.dot.restype = _i
        self.dot_task = recording.task_pointer(lib, "gguf_repack_dot_task")
        self._lib = lib


_load_lock = threading.Lock()
_kernel: list[GGUFRepackKernel | None] = []


def kernel() -> GGUFRepackKernel | None:
    """This process's library (built on first use), or None without a compiler."""
    if not _kernel:
        with _load_lock:
            if not _kernel:
                _kernel.append(native.load_kernels(_SOURCE, GGUFRepackKernel, "GGUF repacked GEMM",
                                                   "the block dot product"))
    return _kernel[0]


def available() -> bool:
    """Whether layers repack: the library loads, the CPU has AVX512-VNNI and the process's GGUF path
    (``envs.GGUF_DOT_ISA``) is the AVX512 one."""
    k = kernel()
    return k is not None and k.available and gguf_dot.kernel() is not None and gguf_dot.process_isa() == 2


@dataclass(frozen=True)
class RepackedWeight:
    """An (N, K) weight in the repacked layout: ``codes`` uint8, ``scale`` and ``min`` (per tile, group and lane)
    float16 where every value is a half exactly (the legacy types, whose file stores half scales), else float32 (a
    K-quant's scale is a half times a 6- or 8-bit integer), ``bits`` per code (4 or 8), ``sub`` (k per code
    sub-block: 32, or 16 for Q6_K) and ``group`` (k per scale: a multiple of sub dividing K)."""

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    bits: int
    sub: int
    out_features: int
    in_features: int
    group: int


def repack(block_type: int, blocks: torch.Tensor, in_features: int) -> RepackedWeight:
    """``blocks`` (N, row bytes) uint8 of ggml type ``block_type`` in the repacked layout. Raises ValueError for a
    type or shape gguf_dot does not take (:func:`gguf_dot.dequantize_rows`'s checks)."""
    dk = gguf_dot.kernel()
    gguf_dot.check_weight(dk, block_type, blocks, in_features)
    n = blocks.shape[0]
    bits, sub = (4 if block_type in _FOUR_BIT else 8), (16 if block_type in _SUB16 else 32)
    codes = torch.empty(n, in_features, dtype=torch.uint8)
    scale16 = torch.empty(n, in_features // 16)
    min16 = torch.empty(n, in_features // 16)
    threads = gguf_dot.num_threads(n * in_features)
    if n and dk.unpack(block_type, blocks.data_ptr(), blocks.stride(0), n, in_features, codes.data_ptr(),
                      scale16.data_ptr(), min16.data_ptr(), threads):
        raise ValueError(f"gguf_unpack_rows refused {gguf_dot.BLOCK_TYPES[block_type]}")
    if sub == 32 and n and not (torch.equal(scale16[:, 0::2], scale16[:, 1::2])
                                and torch.equal(min16[:, 0::2], min16[:, 1::2])):
        raise ValueError(f"{gguf_dot.BLOCK_TYPES[block_type]}: scales differ within a block of 32")
    return _repack(codes, scale16, min16, 16, bits, sub, sub, threads)


def repack_codes(codes: torch.Tensor, scale: torch.Tensor, min: torch.Tensor, bits: int,
                 group: int) -> RepackedWeight:
    """``w[n, k] = scale[n, k // group] * codes[n, k] + min[n, k // group]`` in the repacked layout (sub-blocks
    of 32): ``codes`` (N, K) uint8 below ``2 ** bits`` (bits 4 or 8), ``scale`` and ``min`` (N, K / group) float32,
    ``group`` a multiple of 32 dividing K (K itself: one scale per channel). Raises ValueError for shapes or codes
    outside the layout."""
    n, in_features = codes.shape
    if codes.dtype != torch.uint8 or bits not in (4, 8) or group <= 0 or group % 32 or in_features % group \
            or scale.shape != (n, in_features // group) or min.shape != scale.shape:
        raise ValueError(f"repack_codes: codes {tuple(codes.shape)} {codes.dtype}, scale {tuple(scale.shape)}, "
                         f"min {tuple(min.shape)} do not fit {bits}-bit codes in groups of {group}")
    if bits == 4 and n and int(codes.max()) > 15:
        raise ValueError("repack_codes: 4-bit codes above 15")
    f32 = [t.detach().to(torch.float32).contiguous() for t in (scale, min)]
    return _repack(codes.contiguous(), *f32, group, bits, 32, group, gguf_dot.num_threads(n * in_features))


def _repack(codes: torch.Tensor, scale_in: torch.Tensor, min_in: torch.Tensor, in_step: int, bits: int, sub: int,
            group: int, threads: int) -> RepackedWeight:
    """codes (N, K), scale_in / min_in (N, K / in_step) float32 into the layout, halves where exact (sub 32)."""
    k = kernel()
    n, in_features = codes.shape
    count = k.scale_count(group, n, in_features)
    out = RepackedWeight(torch.empty(k.code_bytes(bits, sub, n, in_features), dtype=torch.uint8),
                         torch.empty(count), torch.empty(count), bits, sub, n, in_features, group)
    if k.repack(codes.data_ptr(), scale_in.data_ptr(), min_in.data_ptr(), in_step, n, in_features, bits, sub, group,
                out.codes.data_ptr(), out.scale.data_ptr(), out.min.data_ptr(), threads):
        raise ValueError(f"gguf_repack refused bits {bits} sub {sub} group {group} K {in_features}")
    if sub == 32 and _halves_exactly(out.scale) and _halves_exactly(out.min):
        out = dataclasses.replace(out, scale=out.scale.half(), min=out.min.half())
    return out


def concat_rows(weights: list[RepackedWeight]) -> list[RepackedWeight]:
    """The weights' rows one after another, as few weights as the layout allows: consecutive weights of one layout
    (bits, sub, group, scale dtype, in_features) join when each but the last fills its tiles of 16 outputs (tiles
    are stored one after another, so the join is a concatenation of the same bytes). A fused layer's parts become
    one product, one call."""
    out: list[RepackedWeight] = []
    for w in weights:
        last = out[-1] if out else None
        if last is not None and last.out_features % _TILE == 0 and _layout(last) == _layout(w):
            out[-1] = dataclasses.replace(last, codes=torch.cat([last.codes, w.codes]),
                                          scale=torch.cat([last.scale, w.scale]), min=torch.cat([last.min, w.min]),
                                          out_features=last.out_features + w.out_features)
        else:
            out.append(w)
    return out


def _layout(w: RepackedWeight) -> tuple:
    return w.bits, w.sub, w.group, w.in_features, w.scale.dtype, w.min.dtype


def _halves_exactly(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.half().float(), t))


def values(w: RepackedWeight, out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The values ``scale * code + min`` of every row (N, K), or of ``rows`` (R,) int64 in that order (R, K) (an
    embedding lookup): float32, or bfloat16 (nearest even) when ``out`` is bfloat16; written into ``out`` (rows
    contiguous) if given. Raises ValueError for an out that does not fit, IndexError for a row outside [0, N)."""
    k = kernel()
    count = w.out_features if rows is None else rows.numel()
    out = torch.empty(count, w.in_features) if out is None else out
    if out.dtype not in (torch.float32, torch.bfloat16) or out.shape != (count, w.in_features) \
            or (count and out.stride(1) != 1):
        raise ValueError(f"values: out must be float32 or bfloat16 ({count}, {w.in_features}) with contiguous rows, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
    if count:
        rc = k.values(w.codes.data_ptr(), w.scale.data_ptr(), w.min.data_ptr(), int(w.scale.dtype == torch.float16),
                      w.out_features, w.in_features, w.bits, w.sub, w.group, None if rows is None else rows.data_ptr(),
                      count,
                      out.data_ptr(), out.stride(0), int(out.dtype == torch.bfloat16),
                      gguf_dot.num_threads(count * w.in_features))
        if rc == -2:
            raise IndexError(f"values: a row outside [0, {w.out_features})")
    return out


def dot(w: RepackedWeight, x: gguf_dot.QuantizedRows, out: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """``out[m, n] = bias[n] + x[m] . W[n]`` (recorded into an active CPU decode graph): out a float32 (M, N) view
    with contiguous rows (a column slice of a wider output is fine), bias float32 (N,) or None. Raises ValueError
    for shapes that do not fit, RuntimeError on a CPU without AVX512-VNNI."""
    n, m = w.out_features, x.num_rows
    if x.in_features != w.in_features or out.dtype != torch.float32 or out.shape != (m, n) \
            or (n and m and out.stride(1) != 1):
        raise ValueError(f"dot: x ({m}, {x.in_features}) and out {tuple(out.shape)} {out.dtype} do not fit the "
                         f"weight ({n}, {w.in_features})")
    if not n or not m:
        return
    rc = recording.call(kernel().dot, w.codes.data_ptr(), w.scale.data_ptr(), w.min.data_ptr(),
                        int(w.scale.dtype == torch.float16), w.bits, w.sub, w.group, n,
                        w.in_features, x.q.data_ptr(), x.d.data_ptr(), x.s.data_ptr(), x.s16.data_ptr(), m,
                        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
                        num_threads(m, n, w.in_features), keep=(w, bias),
                        task=(kernel().dot_task, num_threads(m, n, w.in_features, spinning=True)))
    if rc != 0:
        raise RuntimeError("gguf_repack_dot needs AVX512-VNNI")


def linear(weights: list[RepackedWeight], x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A layer whose rows are ``weights`` one after another (a fused layer's parts, :func:`concat_rows`): x (T, K)
    float32 or bfloat16 on the CPU, quantized once to :func:`gguf_dot.quantize_rows`'s int8 blocks of 32, times
    each part -> (T, sum of N) float32 (+ bias float32 (sum of N,)). Each call is recorded into an active CPU decode
    graph. Raises ValueError as :func:`dot` and :func:`gguf_dot.quantize_rows`."""
    rows = gguf_dot.quantize_rows(x if x.stride(1) == 1 else x.contiguous())
    out, start = torch.empty(x.shape[0], sum(w.out_features for w in weights)), 0
    for w in weights:
        dot(w, rows, out[:, start:start + w.out_features], None if bias is None else bias[start:start + w.out_features])
        start += w.out_features
    return out
