"""CPU paged-attention backend with fused C decode and prefill kernels (``cpu_paged.c``).

:class:`CpuPagedAttention` is a :class:`~pagedllm.attention.torch_paged.TorchPagedAttention`
that differs in how it runs attention:

- **Decodes**: instead of gathering every request's K/V blocks into a workspace
  (``index_select``) and calling SDPA on the copy, a small C kernel reads each K and V row once,
  straight through the block table, with an online softmax (Milakov & Gimelshein 2018;
  FlashAttention's tiling), all query heads of a GQA group sharing each row.
- **Prefills** (fresh prompts, chunked prefill, prefix-cache hits): a tiled kernel in
  FlashAttention-2's loop order (query tile x KV head per work item, register-blocked Q K^T and
  P V micro-kernels, online softmax) reads the cached prefix and the chunk's own K/V alike in
  place through the block table: no gathered copy of the prefix, no (chunk x context) mask or
  score matrix, no second call and merge for the chunk, and no repeated K/V for GQA.

- **K/V writes** (the slot mapping) into float32/bfloat16 caches: done in C by the decode call
  itself (one call per layer for a decode step), validated once per step.

Sliding windows and logit soft-capping run in both kernels; fp8/int8 cache writes are the inherited torch code.

The kernel is plain C11 with no torch headers, compiled on first use and cached by
:mod:`pagedllm.native` (``$CC``, ``$PAGEDLLM_CACHE_DIR``; with OpenMP on torch's own libgomp)
and loaded with :mod:`ctypes`. One call per layer runs the step's decodes (a prefill request's
work items) over an OpenMP team of ``torch.get_num_threads()`` threads, torch's own worker
threads, so attention and the matmuls around it never compete for the cores. Built without
OpenMP (torch on another OpenMP runtime), the work is split into contiguous ranges (balanced by
cost) run on a persistent thread pool (ctypes releases the GIL). When no compiler is found or
the build fails, one warning is logged and the backend behaves exactly like the torch one.

Supported by the decode kernel: contiguous KV caches of every ``kv_cache_dtype`` — float32,
bfloat16, float8 e4m3fn/e5m2 and int8 with its per token-and-head scales
(:mod:`pagedllm.quantization.kv_cache`; the kernel dequantizes as it reads, no gather copy;
computed in float32, float32 and bfloat16 queries and outputs taken and written as they are) — on CPU with head_dim a multiple of 16 (up to 256) and up to 256 query heads; anything else
(float16 caches, non-CPU tensors, odd head sizes) goes to the torch backend. The prefill kernel takes
float32 and bfloat16 caches with head_dim a multiple of 64 (fp8/int8 caches prefill with the torch code) and
computes in float32 whatever the query dtype (float32 and bfloat16 queries and outputs read and
written in place, others converted).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import logging
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm import native
from pagedllm.attention.backend import (AttentionMetadata, ForwardContext, check_shapes, current_context,
                                        write_kv_cache)
from pagedllm.attention.decode_plan import DecodeCall, DecodePlan
from pagedllm.attention.torch_paged import TorchPagedAttention
from pagedllm.utils import cdiv

logger = logging.getLogger(__name__)

__all__ = ["CpuPagedAttention", "CpuPagedKernel", "load_kernel"]

_SOURCE = native.SOURCE_DIR / "cpu_paged.c"
_ABI_VERSION = 7

_c_int, _c_ll, _c_float, _c_void_p = ctypes.c_int, ctypes.c_longlong, ctypes.c_float, ctypes.c_void_p
# paged_decode_<format>(q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, out, req_begin, req_end,
#   num_heads, num_kv_heads, head_dim, block_size, block_table_stride, kv_block_stride, kv_token_stride, scale,
#   k_scale, v_scale, window, soft_cap, io_bf16, num_threads, key, value, key_stride, value_stride, slots,
#   num_tokens) -> int
_ARGTYPES = ([_c_void_p] * 8 + [_c_int] * 6 + [_c_ll] * 3 + [_c_float] * 3 + [_c_int, _c_float, _c_int, _c_int]
             + [_c_void_p] * 2 + [_c_ll] * 2 + [_c_void_p, _c_int])
_WRITE_DTYPES = (torch.float32, torch.bfloat16)  # caches (and new K/V dtypes) the kernel writes itself
# the kernel's function per KV-cache storage dtype
_KERNEL_NAMES = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16",
                 torch.float8_e4m3fn: "paged_decode_fp8_e4m3", torch.float8_e5m2: "paged_decode_fp8_e5m2",
                 torch.int8: "paged_decode_int8"}
# paged_prefill_{f32,bf16}(q, k_cache, v_cache, block_table, out, num_queries, num_context, num_heads,
#   num_kv_heads, head_dim, block_size, kv_block_stride, kv_token_stride, scale, item_begin, item_end, io_bf16,
#   num_threads, window, soft_cap) -> int
_PREFILL_ARGTYPES = [_c_void_p] * 5 + [_c_int] * 6 + [_c_ll] * 2 + [_c_float] + [_c_int] * 5 + [_c_float]
_IO_DTYPES = (torch.float32, torch.bfloat16)  # query/output dtypes the kernels read and write directly
_PREFILL_KERNEL_NAMES = {torch.float32: "paged_prefill_f32", torch.bfloat16: "paged_prefill_bf16"}
_NO_TABLES = torch.zeros((1, 1), dtype=torch.int32)  # the block tables of a write-only call (never read)


class CpuPagedKernel:
    """The loaded shared library: ``decode(...)`` runs the fused kernel on a range of requests.

    Obtain it with :func:`load_kernel`; its functions release the GIL while they run.
    ``has_openmp``: built with OpenMP, so one call splits its work over ``num_threads`` threads
    (else it runs on the calling thread and the caller splits the work). ``call_fns[dtype]``: the
    decode kernel per KV-cache dtype taking its arguments as one
    :class:`~pagedllm.attention.decode_plan.DecodeCall` (used by :class:`DecodePlan`).
    """

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        lib.pagedllm_cpu_paged_abi_version.restype = _c_int
        if lib.pagedllm_cpu_paged_abi_version() != _ABI_VERSION:
            raise OSError(f"{path}: ABI version mismatch")
        lib.pagedllm_cpu_paged_max_heads.restype = _c_int
        lib.pagedllm_cpu_paged_max_head_dim.restype = _c_int
        self.max_heads: int = lib.pagedllm_cpu_paged_max_heads()
        self.max_head_dim: int = lib.pagedllm_cpu_paged_max_head_dim()
        lib.pagedllm_cpu_paged_prefill_block_queries.argtypes = [_c_int]
        lib.pagedllm_cpu_paged_prefill_block_queries.restype = _c_int
        lib.pagedllm_cpu_paged_openmp.restype = _c_int
        self.has_openmp = bool(lib.pagedllm_cpu_paged_openmp())
        # prefill_preferred's rule; the library is built with -march=native, so torch's CPU
        # capability names the build's vector ISA (tests set True to run every layer here)
        self.prefill_all_layers = torch.backends.cpu.get_cpu_capability() == "AVX512"
        self.path = path
        self._fns, self._prefill_fns, self.call_fns = {}, {}, {}
        for dtype, name in _KERNEL_NAMES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = _ARGTYPES, _c_int
            self._fns[dtype] = fn
            call = getattr(lib, f"{name}_call")  # the same kernel taking one DecodeCall struct (decode_plan.py)
            call.argtypes, call.restype = [ctypes.POINTER(DecodeCall)], _c_int
            self.call_fns[dtype] = call
        for dtype, name in _PREFILL_KERNEL_NAMES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = _PREFILL_ARGTYPES, _c_int
            self._prefill_fns[dtype] = fn
        self._lib = lib  # keep the library loaded

    def supports(self, dtype: torch.dtype, num_heads: int, head_dim: int) -> bool:
        """Whether the kernel handles a KV cache of ``dtype`` (float32, bfloat16, float8 e4m3fn/e5m2,
        int8) with these shapes (``num_heads <= max_heads``; ``head_dim`` a multiple of 16, ``<= max_head_dim``)."""
        return (dtype in self._fns and 1 <= num_heads <= self.max_heads and head_dim % 16 == 0
                and 0 < head_dim <= self.max_head_dim)

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, out: torch.Tensor, req_begin: int, req_end: int, scale: float,
               sliding_window: int | None = None, logit_soft_cap: float | None = None,
               kv_scales: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
               num_threads: int = 1, write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """Decode attention of requests ``[req_begin, req_end)`` into ``out``, over ``num_threads``
        threads when :attr:`has_openmp` (the result does not depend on it), after the step's K/V
        write when ``write`` is given. Nothing is checked here (a bad block id or slot reads or
        writes out of bounds): :class:`CpuPagedAttention` validates the block tables, ``seq_lens``
        and slots once per step.

        Args:
            query, out: (D, num_heads, head_dim), both float32 or both bfloat16 (computed in float32,
                the output rounded to nearest even), contiguous, CPU; ``out`` is written.
            kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim), contiguous, a dtype of
                :meth:`supports`.
            block_tables: (>= D, max_blocks) int32 with a unit last stride; ids < num_blocks.
            seq_lens: (>= D,) int32 contiguous; 1 <= seq_lens[r] <= max_blocks * block_size.
            sliding_window: attend to the last W tokens only (None: all); logit_soft_cap: c or None.
            kv_scales: an int8 cache's (2, num_blocks, block_size, num_kv_heads) float32 scales,
                contiguous (read for int8 only).
            k_scale, v_scale: per-tensor scales (stored = value / scale; vLLM's fp8 ``k_scale``/``v_scale``).
            write: ``(key, value, slots)``: the step's new K/V, (T, num_kv_heads, head_dim) each in
                ``query``'s dtype with unit strides within a row (views of the fused projection
                output are fine), written first to the (T,) int64 contiguous ``slots`` of a float32
                or bfloat16 cache (:func:`~pagedllm.attention.backend.write_kv_cache`'s result).
        Raises:
            MemoryError: when the kernel cannot allocate its per-thread scratch (a few KiB).
        """
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        kv_block_stride = block_size * num_kv_heads * head_dim
        k_scales = v_scales = 0
        if kv_scales is not None:
            k_scales = kv_scales.data_ptr()
            v_scales = k_scales + num_blocks * block_size * num_kv_heads * kv_scales.element_size()
        key = value = slots = None
        num_tokens = 0
        if write is not None:
            key, value, slots = write
            num_tokens = key.shape[0]
        cache = kv_cache.data_ptr()
        status = self._fns[kv_cache.dtype](
            query.data_ptr(), cache, cache + num_blocks * kv_block_stride * kv_cache.element_size(), k_scales,
            v_scales, block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), req_begin, req_end,
            query.shape[1], num_kv_heads, head_dim, block_size, block_tables.stride(0), kv_block_stride,
            num_kv_heads * head_dim, scale, k_scale, v_scale, sliding_window or 0, logit_soft_cap or 0.0,
            query.dtype == torch.bfloat16, num_threads, key.data_ptr() if key is not None else None,
            value.data_ptr() if value is not None else None, key.stride(0) if key is not None else 0,
            value.stride(0) if value is not None else 0, slots.data_ptr() if slots is not None else None,
            num_tokens)
        if status != 0:
            raise MemoryError("CPU paged-attention decode kernel: scratch allocation failed")

    def write(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Only the K/V write of :meth:`decode` (its ``write`` argument; no attention), on the calling
        thread. key, value: (T, num_kv_heads, head_dim), both float32 or both bfloat16, unit strides
        within a row; kv_cache float32 or bfloat16, contiguous; slots (T,) int64 contiguous, each in
        ``[0, num_blocks * block_size)`` (not checked here)."""
        self.decode(key, kv_cache, _NO_TABLES, slots, key, 0, 0, 1.0, write=(key, value, slots))

    def supports_prefill(self, dtype: torch.dtype, num_heads: int, head_dim: int) -> bool:
        """Whether :meth:`prefill` handles a KV cache of ``dtype`` (float32, bfloat16) with these
        shapes (``head_dim`` a multiple of 64, ``<= max_head_dim``)."""
        return dtype in self._prefill_fns and num_heads >= 1 and head_dim % 64 == 0 and 0 < head_dim <= self.max_head_dim

    def prefill_preferred(self, logit_soft_cap: float | None) -> bool:
        """Whether :meth:`prefill` is the faster path on this CPU for a layer with this soft cap (the
        caller falls back to the torch code otherwise). AVX-512 builds: always. Elsewhere (AVX2,
        16 registers) only soft-capped layers, where torch's path is the masked math one: for plain
        causal and sliding-window attention torch's fused flash kernel is faster there
        (benchmarks/prefill_attention.py, AVX2 EPYC: the kernel at 0.15x causal, 0.6x window, 1.5x
        soft cap, 3.2x window + soft cap)."""
        return self.prefill_all_layers or bool(logit_soft_cap)

    def prefill_work_items(self, num_queries: int, num_context: int, num_heads: int, num_kv_heads: int,
                           sliding_window: int | None = None) -> list[int]:
        """The prefill kernel's work items for one request, in order, as their cost: item
        ``tile * num_kv_heads + kvh`` (one tile of queries x one KV head) reads every key up to
        its tile's last query -- with a sliding window W only those from its first query's
        position - W + 1 -- and scores each against every query of its tile, so its cost is
        (queries in the tile) x (keys read): (query, key) pairs, each a decode token's work for
        one KV head's query group (the unit of ``min_tokens_per_thread``)."""
        block_queries = self._lib.pagedllm_cpu_paged_prefill_block_queries(num_heads // num_kv_heads)
        costs = []
        for tile in range(cdiv(num_queries, block_queries)):
            first_pos = num_context + tile * block_queries
            tile_queries = min(num_queries - tile * block_queries, block_queries)
            last_key = first_pos + tile_queries
            first_key = max(0, first_pos - sliding_window + 1) if sliding_window else 0
            costs += [tile_queries * (last_key - first_key)] * num_kv_heads
        return costs

    def prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor,
                num_context: int, scale: float, item_begin: int, item_end: int, num_threads: int = 1,
                sliding_window: int | None = None, logit_soft_cap: float | None = None) -> None:
        """Causal prefill attention of one request's Q new tokens (positions ``num_context`` ..
        ``num_context + Q - 1``) over its keys 0 .. num_context + Q - 1 (with ``sliding_window`` W,
        the token at position p over keys p - W < k <= p only; blocks wholly before that are never
        read), scores soft-capped to ``c * tanh(s / c)`` with ``logit_soft_cap`` c, read in place through
        ``block_table`` (the new tokens' K/V must already be in the cache), for work items
        ``[item_begin, item_end)`` of :meth:`prefill_work_items`, over ``num_threads`` threads when
        :attr:`has_openmp` (the result does not depend on it). Nothing is checked here (a bad
        block id reads out of bounds): :class:`CpuPagedAttention` validates the block table.

        Args:
            query, out: (Q, num_heads, head_dim), both float32 or both bfloat16, contiguous, CPU;
                ``out``'s rows of the items' queries and heads are written.
            kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim) float32 or bfloat16, contiguous.
            block_table: (>= ceil((num_context + Q) / block_size),) int32, contiguous, ids < num_blocks.
            sliding_window: W >= 1 or None; logit_soft_cap: c > 0 or None (Gemma 2's
                ``attn_logit_softcapping``).
        Raises:
            MemoryError: when the kernel cannot allocate its scratch (a few hundred KiB).
        """
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        kv_block_stride = block_size * num_kv_heads * head_dim
        status = self._prefill_fns[kv_cache.dtype](
            query.data_ptr(), kv_cache.data_ptr(), kv_cache.data_ptr() + num_blocks * kv_block_stride *
            kv_cache.element_size(), block_table.data_ptr(), out.data_ptr(), query.shape[0], num_context,
            query.shape[1], num_kv_heads, head_dim, block_size, kv_block_stride, num_kv_heads * head_dim, scale,
            item_begin, item_end, query.dtype == torch.bfloat16, num_threads, sliding_window or 0,
            logit_soft_cap or 0.0)
        if status != 0:
            raise MemoryError("CPU paged-attention prefill kernel: scratch allocation failed")


_load_lock = threading.Lock()
_loaded: dict[str, CpuPagedKernel | None] = {}


def load_kernel() -> CpuPagedKernel | None:
    """Compile (once per source/flags/CPU, cached on disk by :mod:`pagedllm.native`) and load the kernel.

    Returns None, after logging one warning per process and compiler, when the compiler is
    missing or the build or load fails; never raises for those. The compiler is ``$CC``
    (default ``cc``; may carry words, e.g. ``"ccache gcc"``), read at call time; results are
    memoised per compiler.
    """
    compiler = os.environ.get("CC", "cc")
    with _load_lock:
        if compiler not in _loaded:
            try:
                _loaded[compiler] = CpuPagedKernel(_build(compiler))
            except (OSError, subprocess.SubprocessError, AttributeError) as e:
                logger.warning("CPU paged-attention kernel unavailable (%s); using the PyTorch backend", e)
                _loaded[compiler] = None
        return _loaded[compiler]


def _build(compiler: str, extra_flags: tuple[str, ...] = (), openmp: bool = True) -> Path:
    """Path of the compiled library (:func:`pagedllm.native.build_library`; with ``openmp``, OpenMP
    when torch's libgomp is available), building it if absent. Raises OSError/SubprocessError on failure."""
    return native.build_library(_SOURCE, extra_flags, openmp=openmp, compiler=compiler)


_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _get_pool(num_workers: int) -> ThreadPoolExecutor:
    """A process-wide pool with at least ``num_workers`` threads (replaced by a larger one if needed)."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < num_workers:
            old, _pool, _pool_size = _pool, ThreadPoolExecutor(num_workers, "pagedllm-attn"), num_workers
            if old is not None:
                old.shutdown(wait=False)  # lets its in-flight calls finish
        return _pool


@dataclass
class _PrefillPlan:
    """The step's prefill block tables, validated once and shared by all layers of a forward pass."""

    owner: ForwardContext | None
    num_blocks: int  # the cache's num_blocks the block ids were checked against
    block_tables: torch.Tensor  # (P, max_blocks) int32 contiguous: the prefill requests' rows


@dataclass
class _KernelPlan:
    """Per-step inputs shared by all layers of one forward pass: the decodes' and the K/V write's."""

    owner: ForwardContext | None
    num_blocks: int  # the cache's num_blocks the block ids and slots were checked against
    block_tables: torch.Tensor  # (D, max_blocks) int32, unit last stride
    seq_lens: torch.Tensor  # (D,) int32 contiguous
    num_threads: int  # threads for the decodes (fewer when the step's context is short)
    ranges: list[tuple[int, int]]  # without OpenMP: request ranges, one per thread, balanced by context length
    slots: torch.Tensor | None  # (T,) int64 contiguous, all inside the cache; None: the torch code writes


class CpuPagedAttention(TorchPagedAttention):
    """Paged attention on CPU with a fused C decode kernel (the ``AttentionBackend`` protocol).

    A :class:`TorchPagedAttention` whose decodes and prefills run in the C kernels: ``forward``
    (K/V write through the slot mapping, decodes, then prefills) is inherited unchanged, only
    :meth:`_decode` and :meth:`_prefill` are replaced. Each falls back to the torch code when the
    kernel is unavailable or does not handle the cache (see :meth:`CpuPagedKernel.supports`,
    :meth:`CpuPagedKernel.supports_prefill`; non-CPU or non-contiguous caches).

    Args:
        num_threads: threads for the kernels; default (None) ``torch.get_num_threads()`` at each
            step (read on the calling thread and passed to the kernel: OpenMP's own default on
            the engine's thread need not follow ``torch.set_num_threads``).
        min_tokens_per_thread: context tokens (summed over the decodes; for a prefill, (query,
            key) pairs summed over its work items, :meth:`CpuPagedKernel.prefill_work_items`)
            each thread must get before the work is split; the default 2048 is ~0.1 ms of
            decode kernel work, several times the cost of waking a thread team (tens of
            microseconds).
        kernel: a loaded :class:`CpuPagedKernel`; default :func:`load_kernel` (None when the
            build fails: the backend then is exactly the torch one).
        plan_decodes: prepare a decode-only step's kernel call once for all layers
            (:class:`~pagedllm.attention.decode_plan.DecodePlan`; the same results, less Python
            per layer); False makes every layer's call from scratch (tests compare the two).

    Extra errors from ``forward``: ValueError when a decode's or prefill's block table names a block
    outside the cache or is too short for its ``seq_len`` (the kernel trusts its inputs, so
    they are checked once per step). One instance may be shared by every layer of a model,
    not by two threads running forwards at the same time (it caches the current pass's plan).
    """

    def __init__(self, num_threads: int | None = None, kernel: CpuPagedKernel | None = None,
                 min_tokens_per_thread: int = 2048, plan_decodes: bool = True) -> None:
        super().__init__()
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if min_tokens_per_thread < 1:
            raise ValueError(f"min_tokens_per_thread must be >= 1, got {min_tokens_per_thread}")
        self.num_threads = num_threads
        self.min_tokens_per_thread = min_tokens_per_thread
        self.kernel = kernel if kernel is not None else load_kernel()
        self._kernel_plan_cache: _KernelPlan | None = None
        self._prefill_plan_cache: _PrefillPlan | None = None
        self.plan_decodes = plan_decodes
        self._planned_decode: DecodePlan | None = None  # the current decode-only step's prepared call

    @property
    def is_kernel_available(self) -> bool:
        """False when the C kernel could not be built: every call then runs the torch code."""
        return self.kernel is not None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                logit_soft_cap: float | None = None, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`TorchPagedAttention.forward` (same arguments, result and errors) with the K/V write
        done by the kernel when the cache is float32 or bfloat16 and the new K/V are in the query's
        dtype: for a decode step one C call per layer writes the new rows and runs the attention.
        Other caches are written by :func:`~pagedllm.attention.backend.write_kv_cache`.

        In a decode-only step the first layer that takes the kernel's one-call path prepares the
        call for the others (:class:`~pagedllm.attention.decode_plan.DecodePlan`): a later layer
        whose tensors and options match it only supplies its pointers (same kernel, same results)."""
        decode_plan = self._planned_decode
        if (decode_plan is not None and kv_scales is None and decode_plan.owner is current_context(metadata)
                and decode_plan.matches(query, key, value, kv_cache, scale, sliding_window, logit_soft_cap)):
            return decode_plan.run(query, key, value, kv_cache)
        kernel = self.kernel
        if kernel is None or kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            return super().forward(query, key, value, kv_cache, metadata, scale, sliding_window, logit_soft_cap,
                                   kv_scales)
        check_shapes(query, key, kv_cache)
        plan = self._kernel_plan(metadata, kv_cache)
        decode_plan = self._plan_decode(query, key, value, kv_cache, metadata, plan, scale, sliding_window,
                                        logit_soft_cap, kv_scales)
        if decode_plan is not None:
            return decode_plan.run(query, key, value, kv_cache)
        write = None
        if (plan.slots is not None and kv_cache.dtype in _WRITE_DTYPES and key.dtype in _WRITE_DTYPES
                and value.dtype == key.dtype and key.shape[0] == value.shape[0] == plan.slots.shape[0]
                and _rows_fit(key) and _rows_fit(value)):
            write = (key, value, plan.slots)
        else:
            write_kv_cache(key, value, kv_cache, metadata.slot_mapping, kv_scales)
        output = torch.empty_like(query)
        num_decodes = metadata.num_decodes
        if num_decodes == query.shape[0]:  # a decode-only step: no slicing
            write = self._decode(query, kv_cache, metadata, scale, output, sliding_window, logit_soft_cap,
                                 kv_scales, write=write)
        elif num_decodes > 0:
            write = self._decode(query[:num_decodes], kv_cache, metadata, scale, output[:num_decodes],
                                 sliding_window, logit_soft_cap, kv_scales, write=write)
        if write is not None:  # no decode kernel call took it
            kernel.write(*write, kv_cache)
        if num_decodes < metadata.num_reqs:
            self._prefill(query, key, value, kv_cache, metadata, scale, output, sliding_window, logit_soft_cap,
                          kv_scales)
        return output

    __call__ = forward

    def _plan_decode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     metadata: AttentionMetadata, plan: _KernelPlan, scale: float, sliding_window: int | None,
                     logit_soft_cap: float | None, kv_scales: torch.Tensor | None) -> DecodePlan | None:
        """The step's :class:`DecodePlan` (also kept for the next layers) when this call is one the
        plan makes exactly as :meth:`forward` would: a decode-only step of the current forward
        context, an OpenMP kernel, a float32/bfloat16 cache it writes itself (valid slots), and
        query/out read and written in place (contiguous CPU query, K/V in its dtype and row
        layout); else None (and no plan is kept)."""
        kernel = self.kernel
        owner = current_context(metadata)
        self._planned_decode = None
        if not (self.plan_decodes and owner is not None and plan.owner is owner and kernel.has_openmp
                and kv_scales is None and 0 < metadata.num_decodes == query.shape[0] == metadata.num_reqs and plan.slots is not None
                and kv_cache.dtype in _WRITE_DTYPES and query.dtype in _IO_DTYPES and query.is_contiguous()
                and key.dtype == value.dtype == query.dtype and key.shape[0] == value.shape[0] == plan.slots.shape[0]
                and _rows_fit(key) and _rows_fit(value) and query.is_cpu
                and kernel.supports(kv_cache.dtype, query.shape[1], kv_cache.shape[-1])):
            return None
        self._planned_decode = DecodePlan(owner, kernel.call_fns[kv_cache.dtype], query, key, value, kv_cache,
                                          plan.block_tables, plan.seq_lens, plan.slots, scale, sliding_window,
                                          logit_soft_cap, plan.num_threads)
        return self._planned_decode

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, out: torch.Tensor, sliding_window: int | None = None,
                logit_soft_cap: float | None = None, kv_scales: torch.Tensor | None = None,
                write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Attention of the decode requests into ``out``. query, out: (D, num_heads, head_dim).

        One kernel call over an OpenMP team (float32 and bfloat16 queries read, and outputs
        written, in place) that first does the step's K/V ``write`` (see
        :meth:`CpuPagedKernel.decode`) when its K/V are in the query's dtype; without OpenMP
        the D requests are split into contiguous ranges of about equal total context, each run
        in the kernel (GIL released), the first on the calling thread. Returns ``write`` when it
        is still to be done (the caller writes before anything reads the cache), else None.
        """
        kernel = self.kernel
        if not (kernel is not None and kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
                and kernel.supports(kv_cache.dtype, query.shape[1], kv_cache.shape[-1])
                and (kv_cache.dtype != torch.int8 or _scales_fit(kv_scales, kv_cache))):
            if write is not None:
                kernel.write(*write, kv_cache)
            super()._decode(query, kv_cache, metadata, scale, out, sliding_window, logit_soft_cap, kv_scales)
            return None
        plan = self._kernel_plan(metadata, kv_cache)
        q, result = _io_tensors(query, out)
        if write is not None and (write[0].dtype != q.dtype or not kernel.has_openmp):
            kernel.write(*write, kv_cache)
            write = None
        if kernel.has_openmp:
            kernel.decode(q, kv_cache, plan.block_tables, plan.seq_lens, result, 0, q.shape[0], scale, sliding_window,
                          logit_soft_cap, kv_scales, num_threads=plan.num_threads, write=write)
        else:
            _run_split(lambda *a: kernel.decode(*a, scale, sliding_window, logit_soft_cap, kv_scales), plan.ranges,
                       q, kv_cache, plan.block_tables, plan.seq_lens, result)
        if result is not out:
            out.copy_(result)
        return None

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata, scale: float, output: torch.Tensor, sliding_window: int | None = None,
                 logit_soft_cap: float | None = None, kv_scales: torch.Tensor | None = None) -> None:
        """Attention of the prefill requests into their rows of ``output``, in the C kernel: each
        request's queries over all its keys (cached prefix and the chunk itself, already written)
        read in place through its block table, in one pass with no gather, no mask and no merge.
        A request's work items run in one call over an OpenMP team (without OpenMP: split into
        ``num_threads`` contiguous ranges of about equal cost on the pool). Sliding-window and
        soft-capped layers run in the kernel too (window and cap applied per S tile, keys before
        the window never read); caches the kernel does not handle (see
        :meth:`CpuPagedKernel.supports_prefill`) and layers it is slower for on this CPU
        (:meth:`CpuPagedKernel.prefill_preferred`) use the torch code."""
        kernel = self.kernel
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
        if not (kernel is not None and kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
                and kernel.supports_prefill(kv_cache.dtype, num_heads, kv_cache.shape[-1])
                and kernel.prefill_preferred(logit_soft_cap)):
            super()._prefill(query, key, value, kv_cache, metadata, scale, output, sliding_window, logit_soft_cap,
                             kv_scales)
            return
        tables = self._prefill_plan(metadata, kv_cache).block_tables
        qsl, seq_lens, num_decodes = metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.num_decodes
        for b in range(num_decodes, metadata.num_reqs):
            start, end = qsl[b], qsl[b + 1]
            rows = output[start:end]
            q, result = _io_tensors(query[start:end], rows)  # (Q, num_heads, head_dim)
            num_context = seq_lens[b] - (end - start)
            costs = kernel.prefill_work_items(end - start, num_context, num_heads, num_kv_heads, sliding_window)
            num_threads = self._threads_for(sum(costs))
            if kernel.has_openmp:
                kernel.prefill(q, kv_cache, tables[b - num_decodes], result, num_context, scale, 0, len(costs),
                               num_threads, sliding_window, logit_soft_cap)
            else:
                _run_split(lambda *a: kernel.prefill(*a, 1, sliding_window, logit_soft_cap),
                           _balanced_ranges(costs, num_threads), q, kv_cache, tables[b - num_decodes], result,
                           num_context, scale)
            if result is not rows:
                rows.copy_(result)

    def _threads_for(self, num_tokens: int) -> int:
        """Threads for kernel work of ``num_tokens`` context tokens: ``num_threads`` (default
        ``torch.get_num_threads()``), fewer so each gets ``min_tokens_per_thread``; at least 1."""
        return max(1, min(self.num_threads or torch.get_num_threads(), num_tokens // self.min_tokens_per_thread))

    def _prefill_plan(self, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> _PrefillPlan:
        """The prefill requests' int32 block tables, validated once per forward pass (keyed by its
        ForwardContext, as the decode plan)."""
        owner = current_context(metadata)
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        plan = self._prefill_plan_cache
        if owner is not None and plan is not None and plan.owner is owner and plan.num_blocks == num_blocks:
            return plan
        num_decodes = metadata.num_decodes
        tables = metadata.block_tables[num_decodes:metadata.num_reqs].to(device="cpu", dtype=torch.int32).contiguous()
        _validate_tables(tables, metadata.seq_lens_cpu[num_decodes:], num_blocks, block_size, "prefill", num_decodes)
        plan = _PrefillPlan(owner, num_blocks, tables)
        self._prefill_plan_cache = plan if owner is not None else None
        return plan

    def _kernel_plan(self, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> _KernelPlan:
        """Validated int32 block tables / seq_lens and the thread split of the step's decodes, and
        the validated slots of its K/V write, computed once per forward pass (keyed by its
        ForwardContext, as the torch backend's plan)."""
        owner = current_context(metadata)
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        plan = self._kernel_plan_cache
        if owner is not None and plan is not None and plan.owner is owner and plan.num_blocks == num_blocks:
            return plan
        num_decodes = metadata.num_decodes
        lens = metadata.seq_lens_cpu[:num_decodes]
        tables = metadata.block_tables[:num_decodes].to(device="cpu", dtype=torch.int32)
        if tables.dim() != 2 or tables.stride(-1) != 1:
            tables = tables.contiguous()
        if num_decodes:
            _validate_tables(tables, lens, num_blocks, block_size)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        num_threads = self._threads_for(sum(lens))
        ranges = ([] if not num_decodes or (self.kernel is not None and self.kernel.has_openmp)
                  else _balanced_ranges(lens, num_threads))
        plan = _KernelPlan(owner, num_blocks, tables, seq_lens, num_threads, ranges,
                           _checked_slots(metadata.slot_mapping, num_blocks * block_size))
        self._kernel_plan_cache = plan if owner is not None else None
        return plan


def _io_tensors(query: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The query and output buffer the kernel reads and writes: ``query`` and ``out`` themselves when
    both are contiguous and of one dtype in :data:`_IO_DTYPES`, else a float32 copy of the query
    and a fresh float32 buffer (the caller then copies it into ``out``)."""
    if query.dtype in _IO_DTYPES and out.dtype == query.dtype and query.is_contiguous() and out.is_contiguous():
        return query, out
    q = query.to(torch.float32).contiguous()
    return q, torch.empty(q.shape, dtype=torch.float32)


def _rows_fit(new: torch.Tensor) -> bool:
    """Whether new K or V rows (T, num_kv_heads, head_dim) are laid out as the kernel's write reads
    them: each row's heads and dims contiguous (any row stride), on the CPU."""
    strides = new.stride()
    return len(strides) == 3 and strides[2] == 1 and strides[1] == new.shape[2] and new.is_cpu


def _checked_slots(slot_mapping: torch.Tensor, num_slots: int) -> torch.Tensor | None:
    """The step's slot mapping as the kernel's write takes it ((T,) int64 contiguous, CPU) when every
    slot is inside the cache, else None (the torch write then runs and raises its own error)."""
    slots = slot_mapping.to(device="cpu", dtype=torch.int64).contiguous()
    if slots.dim() != 1 or (slots.numel() and not (int(slots.min()) >= 0 and int(slots.max()) < num_slots)):
        return None
    return slots


def _scales_fit(kv_scales: torch.Tensor | None, kv_cache: torch.Tensor) -> bool:
    """Whether an int8 cache's scales are the contiguous float32 (2, num_blocks, block_size,
    num_kv_heads) tensor the kernel indexes (anything else decodes with the torch code)."""
    return (kv_scales is not None and kv_scales.dtype == torch.float32 and kv_scales.is_contiguous()
            and tuple(kv_scales.shape) == tuple(kv_cache.shape[:4]) and kv_scales.device == kv_cache.device)


def _run_split(fn, ranges: list[tuple[int, int]], *args) -> None:
    """``fn(*args, begin, end)`` for every range, the first on the calling thread and the others
    on the pool (ctypes releases the GIL, so they run in parallel); returns when all are done."""
    first, *rest = ranges
    pool = _get_pool(len(rest)) if rest else None
    futures = [pool.submit(fn, *args, *r) for r in rest] if pool else []
    fn(*args, *first)
    for f in futures:
        f.result()


def _validate_tables(tables: torch.Tensor, lens: list[int], num_blocks: int, block_size: int,
                     kind: str = "decode", first_row: int = 0) -> None:
    """The kernel trusts its inputs: check once per step that every read stays inside the cache.
    ``kind`` ("decode" or "prefill") names the requests in the error; ``tables`` row i is the
    step's request ``first_row + i``."""
    max_blocks = tables.shape[1]
    if min(lens) < 1 or max(lens) > max_blocks * block_size:
        raise ValueError(f"{kind} seq_lens must be in [1, {max_blocks * block_size}] (block_tables width "
                         f"{max_blocks} x block_size {block_size}), got min {min(lens)} max {max(lens)}")
    needed = cdiv(max(lens), block_size)
    used = tables[:, :needed]
    # Only the blocks each request actually reads must be valid; padding past its seq_len may be anything.
    valid = torch.arange(needed).unsqueeze(0) < cdiv(torch.tensor(lens), block_size).unsqueeze(1)
    bad = valid & ((used < 0) | (used >= num_blocks))
    if bool(bad.any()):
        r, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_tables[{first_row + r}, {i}] = {int(used[r, i])} is outside the KV cache's "
                         f"{num_blocks} blocks")


def _balanced_ranges(lens: list[int], num_parts: int) -> list[tuple[int, int]]:
    """Split requests 0..len(lens)-1 into at most ``num_parts`` contiguous non-empty ranges of
    about equal total context length (the kernel's cost is linear in it): range k ends after
    the first request at which the running total reaches k/num_parts of the whole."""
    num_reqs = len(lens)
    num_parts = max(1, min(num_parts, num_reqs))
    cumulative = list(itertools.accumulate(lens))
    bounds = [0]
    for k in range(1, num_parts):
        end = bisect.bisect_left(cumulative, cumulative[-1] * k / num_parts) + 1
        bounds.append(max(bounds[-1] + 1, min(end, num_reqs - (num_parts - k))))
    bounds.append(num_reqs)
    return list(zip(bounds[:-1], bounds[1:]))
