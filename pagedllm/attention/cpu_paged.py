"""The CPU paged-attention backend: the fused C kernels of ``cpu_paged.c`` (``docs/attention.md``) behind
the torch backend, which runs whatever they do not take or when they do not build."""

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
                                        step_context, write_kv_cache)
from pagedllm.attention.decode_plan import DecodeCall, DecodePlan
from pagedllm.ops import recording
from pagedllm.attention.torch_paged import TorchPagedAttention, TorchPagedAttentionImpl
from pagedllm.utils import cdiv

logger = logging.getLogger(__name__)

__all__ = ["CpuPagedAttention", "CpuPagedAttentionImpl", "CpuPagedKernel", "load_kernel"]

_SOURCE = native.SOURCE_DIR / "cpu_paged.c"
_ABI_VERSION = 7

_c_int, _c_ll, _c_float, _c_void_p = ctypes.c_int, ctypes.c_longlong, ctypes.c_float, ctypes.c_void_p
# argument order: paged_decode_f32 in cpu_paged.c
_ARGTYPES = ([_c_void_p] * 8 + [_c_int] * 6 + [_c_ll] * 3 + [_c_float] * 3 + [_c_int, _c_float, _c_int, _c_int]
             + [_c_void_p] * 2 + [_c_ll] * 2 + [_c_void_p, _c_int])
_WRITE_DTYPES = (torch.float32, torch.bfloat16)  # caches (and new K/V dtypes) the kernel writes itself
_KERNEL_NAMES = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16",
                 torch.float8_e4m3fn: "paged_decode_fp8_e4m3", torch.float8_e5m2: "paged_decode_fp8_e5m2",
                 torch.int8: "paged_decode_int8"}
# argument order: paged_prefill_f32 in cpu_paged.c
_PREFILL_ARGTYPES = [_c_void_p] * 5 + [_c_int] * 6 + [_c_ll] * 2 + [_c_float] + [_c_int] * 5 + [_c_float]
_IO_DTYPES = (torch.float32, torch.bfloat16)  # query/output dtypes the kernels read and write directly
_PREFILL_KERNEL_NAMES = {torch.float32: "paged_prefill_f32", torch.bfloat16: "paged_prefill_bf16"}
_NO_TABLES = torch.zeros((1, 1), dtype=torch.int32)  # a write-only call's block tables (never read)


class CpuPagedKernel:
    """The loaded library (:func:`load_kernel`); its calls release the GIL. ``has_openmp``: one call
    splits its work over ``num_threads``. ``call_fns[dtype]``: the decode kernel taking a DecodeCall;
    ``task_fns[dtype]``: its task forms (native/native_team.h), the K/V write and the decode."""

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
        # built with -march=native, so torch's CPU capability names the build's ISA (tests set True)
        self.prefill_all_layers = torch.backends.cpu.get_cpu_capability() == "AVX512"
        self.path = path
        self._fns, self._prefill_fns, self.call_fns, self.task_fns = {}, {}, {}, {}
        for dtype, name in _KERNEL_NAMES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = _ARGTYPES, _c_int
            self._fns[dtype] = fn
            call = getattr(lib, f"{name}_call")
            call.argtypes, call.restype = [ctypes.POINTER(DecodeCall)], _c_int
            self.call_fns[dtype] = call
            self.task_fns[dtype] = (recording.task_pointer(lib, f"{name}_write_task"),
                                    recording.task_pointer(lib, f"{name}_task"))
        for dtype, name in _PREFILL_KERNEL_NAMES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = _PREFILL_ARGTYPES, _c_int
            self._prefill_fns[dtype] = fn
        self._lib = lib

    def supports(self, dtype: torch.dtype, num_heads: int, head_dim: int) -> bool:
        return (dtype in self._fns and 1 <= num_heads <= self.max_heads and head_dim % 16 == 0
                and 0 < head_dim <= self.max_head_dim)

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, out: torch.Tensor, req_begin: int, req_end: int, scale: float,
               sliding_window: int | None = None, logit_soft_cap: float | None = None,
               kv_scales: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
               num_threads: int = 1, write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """Decode attention of requests ``[req_begin, req_end)`` into ``out`` after the K/V ``write``;
        unchecked. query, out (D, num_heads, head_dim) both float32 or both bfloat16, contiguous;
        block_tables int32, unit last stride; seq_lens int32 >= 1. Raises MemoryError on scratch failure."""
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
        """Only :meth:`decode`'s ``write``, on the calling thread."""
        self.decode(key, kv_cache, _NO_TABLES, slots, key, 0, 0, 1.0, write=(key, value, slots))

    def supports_prefill(self, dtype: torch.dtype, num_heads: int, head_dim: int) -> bool:
        return dtype in self._prefill_fns and num_heads >= 1 and head_dim % 64 == 0 and 0 < head_dim <= self.max_head_dim

    def prefill_preferred(self, logit_soft_cap: float | None) -> bool:
        """Always on AVX-512; elsewhere only soft-capped layers, where torch has no flash path."""
        return self.prefill_all_layers or bool(logit_soft_cap)

    def prefill_work_items(self, num_queries: int, num_context: int, num_heads: int, num_kv_heads: int,
                           sliding_window: int | None = None) -> list[int]:
        """Cost of each work item ``tile * num_kv_heads + kvh`` of one request: queries x keys read."""
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
        """Causal attention of one request's Q new tokens, items ``[item_begin, item_end)``; unchecked.
        query, out (Q, num_heads, head_dim) both float32 or both bfloat16. Raises MemoryError on scratch failure."""
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
    """The kernel for ``$CC`` (memoised per compiler); None, after one warning, when it fails to build or load."""
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
    """Raises OSError or subprocess.SubprocessError when the build fails."""
    return native.build_library(_SOURCE, extra_flags, openmp=openmp, compiler=compiler)


_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _get_pool(num_workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < num_workers:
            old, _pool, _pool_size = _pool, ThreadPoolExecutor(num_workers, "pagedllm-attn"), num_workers
            if old is not None:
                old.shutdown(wait=False)
        return _pool


@dataclass
class _PrefillPlan:

    owner: ForwardContext | None
    num_blocks: int  # the cache's num_blocks the block ids were checked against
    block_tables: torch.Tensor  # (P, max_blocks) int32 contiguous


@dataclass
class _KernelPlan:

    owner: ForwardContext | None  # the forward context of whose KV-cache groups' metadata this plan is made
    metadata: AttentionMetadata
    num_blocks: int
    block_tables: torch.Tensor  # (D, max_blocks) int32, unit last stride
    seq_lens: torch.Tensor  # (D,) int32 contiguous
    num_threads: int  # threads for the decodes (fewer when the step's context is short)
    ranges: list[tuple[int, int]]  # without OpenMP: request ranges, one per thread, balanced by context length
    slots: torch.Tensor | None  # (T,) int64 contiguous, all inside the cache; None: the torch code writes


class CpuPagedAttentionImpl(TorchPagedAttentionImpl):
    """One layer on :class:`CpuPagedAttention`. Also raises ValueError for a block table naming a block
    outside the cache or too short for its seq_len."""

    backend: CpuPagedAttention

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """In a decode-only step the first layer plans the call for the others (:class:`DecodePlan`)."""
        backend = self.backend
        decode_plan = backend.planned_decode
        if (decode_plan is not None and kv_scales is None and decode_plan.owner is current_context(metadata)
                and decode_plan.matches(query, key, value, kv_cache, self.options)):
            return decode_plan.run(query, key, value, kv_cache)
        kernel = backend.kernel
        if kernel is None or kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            return super().forward(query, key, value, kv_cache, metadata, kv_scales)
        check_shapes(query, key, kv_cache)
        plan = backend.kernel_plan(metadata, kv_cache)
        decode_plan = self._plan_decode(query, key, value, kv_cache, metadata, plan, kv_scales)
        if decode_plan is not None:
            return decode_plan.run(query, key, value, kv_cache)
        write = None
        if (plan.slots is not None and kv_cache.dtype in _WRITE_DTYPES and key.dtype in _WRITE_DTYPES
                and value.dtype == key.dtype and key.shape[0] == value.shape[0] == plan.slots.shape[0]
                and _rows_fit(key) and _rows_fit(value)):
            write = (key, value, plan.slots)
            if metadata.num_decodes == 0:  # no decode call to take it
                kernel.write(*write, kv_cache)
                write = None
        else:
            write_kv_cache(key, value, kv_cache, metadata.slot_mapping, kv_scales)
        return self._attend(query, key, value, kv_cache, metadata, kv_scales, write=write)

    def decode_tasks(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     kv_scales: torch.Tensor | None, out: torch.Tensor, metadata: AttentionMetadata):
        """The planned decode's task forms over one struct (the K/V write on one thread, then the decode split by
        request), when :meth:`forward` just ran this layer through the step's :class:`DecodePlan`; the refresh
        hook re-plans a later step (validating its block tables) and gives its tables', lengths' and slots'
        pointers, or None when that step's call would not be the planned one."""
        backend = self.backend
        plan = backend.planned_decode
        owner = current_context(metadata)
        if kv_scales is not None or backend.kernel is None:
            return None
        if not (plan is not None and owner is not None and plan.owner is owner
                and plan.matches(query, key, value, kv_cache, self.options)):
            # a layer of another KV-cache group (its own plan, not the step's DecodePlan), or no DecodePlan
            kernel_plan = backend.kernel_plan(metadata, kv_cache)
            if kernel_plan.owner is None or not self._plannable(query, key, value, kv_cache, metadata, kernel_plan):
                return None
            plan = DecodePlan(kernel_plan.owner, backend.kernel.call_fns[kv_cache.dtype], self, query, key, value,
                              kv_cache, kernel_plan.block_tables, kernel_plan.seq_lens, kernel_plan.slots,
                              kernel_plan.num_threads)
        call = plan.call_for(query, key, value, kv_cache, out)
        write_fn, decode_fn = backend.kernel.task_fns[kv_cache.dtype]
        name = backend.kernel.call_fns[kv_cache.dtype].__name__
        tasks = [recording.Task(write_fn, call, 1, f"{name} (K/V write)"),
                 recording.Task(decode_fn, call, recording.TEAM, name)]
        rows = query.shape[0]

        def refresh(step: AttentionMetadata | None) -> dict[str, int] | None:
            if step is None or not (step.num_decodes == step.num_reqs == rows):
                return None
            kernel_plan = backend.kernel_plan(step, kv_cache)
            if kernel_plan.slots is None or kernel_plan.owner is None or kernel_plan.slots.shape[0] != rows:
                return None
            tables = kernel_plan.block_tables
            return {"block_tables": tables.data_ptr(), "block_table_stride": tables.stride(0),
                    "seq_lens": kernel_plan.seq_lens.data_ptr(), "slots": kernel_plan.slots.data_ptr()}

        return tasks, refresh

    def _plan_decode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     metadata: AttentionMetadata, plan: _KernelPlan, kv_scales: torch.Tensor | None
                     ) -> DecodePlan | None:
        """The step's :class:`DecodePlan` when it makes this call exactly as :meth:`forward` would; else None."""
        backend = self.backend
        kernel = backend.kernel
        owner = current_context(metadata)
        backend.planned_decode = None
        if not (backend.plan_decodes and owner is not None and plan.owner is owner and kv_scales is None
                and self._plannable(query, key, value, kv_cache, metadata, plan)):
            return None
        backend.planned_decode = DecodePlan(owner, kernel.call_fns[kv_cache.dtype], self, query, key, value,
                                            kv_cache, plan.block_tables, plan.seq_lens, plan.slots, plan.num_threads)
        return backend.planned_decode

    def _plannable(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   metadata: AttentionMetadata, plan: _KernelPlan) -> bool:
        """Whether :meth:`forward` runs this decode-only call as one C call writing the K/V rows first (an unscaled
        cache), which a :class:`DecodePlan` makes as well."""
        kernel = self.backend.kernel
        return (kernel.has_openmp and 0 < metadata.num_decodes == query.shape[0] == metadata.num_reqs
                and plan.slots is not None
                and kv_cache.dtype in _WRITE_DTYPES and query.dtype in _IO_DTYPES and query.is_contiguous()
                and key.dtype == value.dtype == query.dtype and key.shape[0] == value.shape[0] == plan.slots.shape[0]
                and _rows_fit(key) and _rows_fit(value) and query.is_cpu
                and kernel.supports(kv_cache.dtype, query.shape[1], kv_cache.shape[-1]))

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                out: torch.Tensor, kv_scales: torch.Tensor | None = None,
                write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """The decodes into ``out`` (D, num_heads, head_dim) after the K/V ``write``."""
        kernel = self.backend.kernel
        if not (kernel is not None and kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
                and kernel.supports(kv_cache.dtype, query.shape[1], kv_cache.shape[-1])
                and (kv_cache.dtype != torch.int8 or _scales_fit(kv_scales, kv_cache))):
            if write is not None:
                kernel.write(*write, kv_cache)
            super()._decode(query, kv_cache, metadata, out, kv_scales)
            return
        plan = self.backend.kernel_plan(metadata, kv_cache)
        q, result = _io_tensors(query, out)
        if write is not None and (write[0].dtype != q.dtype or not kernel.has_openmp):
            kernel.write(*write, kv_cache)
            write = None
        options = (self.scale, self.sliding_window, self.logit_soft_cap, kv_scales)
        if kernel.has_openmp:
            kernel.decode(q, kv_cache, plan.block_tables, plan.seq_lens, result, 0, q.shape[0], *options,
                          num_threads=plan.num_threads, write=write)
        else:
            _run_split(lambda *a: kernel.decode(*a, *options), plan.ranges, q, kv_cache, plan.block_tables,
                       plan.seq_lens, result)
        if result is not out:
            out.copy_(result)

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata, output: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
        """The prefills' rows of ``output``; the torch code where the kernel does not take the cache or is slower."""
        backend = self.backend
        kernel = backend.kernel
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
        if not (kernel is not None and kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
                and kernel.supports_prefill(kv_cache.dtype, num_heads, kv_cache.shape[-1])
                and kernel.prefill_preferred(self.logit_soft_cap)):
            super()._prefill(query, key, value, kv_cache, metadata, output, kv_scales)
            return
        tables = backend.prefill_plan(metadata, kv_cache).block_tables
        window, soft_cap = self.sliding_window, self.logit_soft_cap
        qsl, seq_lens, num_decodes = metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.num_decodes
        for b in range(num_decodes, metadata.num_reqs):
            start, end = qsl[b], qsl[b + 1]
            rows = output[start:end]
            q, result = _io_tensors(query[start:end], rows)
            num_context = seq_lens[b] - (end - start)
            costs = kernel.prefill_work_items(end - start, num_context, num_heads, num_kv_heads, window)
            num_threads = backend.threads_for(sum(costs))
            if kernel.has_openmp:
                kernel.prefill(q, kv_cache, tables[b - num_decodes], result, num_context, self.scale, 0, len(costs),
                               num_threads, window, soft_cap)
            else:
                _run_split(lambda *a: kernel.prefill(*a, 1, window, soft_cap), _balanced_ranges(costs, num_threads),
                           q, kv_cache, tables[b - num_decodes], result, num_context, self.scale)
            if result is not rows:
                rows.copy_(result)


class CpuPagedAttention(TorchPagedAttention):
    """Paged attention on CPU with the fused C kernels; exactly the torch backend when they do not build.
    ``num_threads`` defaults to ``torch.get_num_threads()`` at each step; ``plan_decodes`` plans a
    decode-only step once for all layers. Raises ValueError for ``num_threads`` or ``min_tokens_per_thread`` < 1."""

    impl_cls = CpuPagedAttentionImpl

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
        self._kernel_plans: list[_KernelPlan] = []  # this forward context's, one per KV-cache group
        self._prefill_plan_cache: _PrefillPlan | None = None
        self.plan_decodes = plan_decodes
        self.planned_decode: DecodePlan | None = None

    @property
    def is_kernel_available(self) -> bool:
        """False when the C kernel could not be built."""
        return self.kernel is not None

    def threads_for(self, num_tokens: int) -> int:
        return max(1, min(self.num_threads or torch.get_num_threads(), num_tokens // self.min_tokens_per_thread))

    def prefill_plan(self, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> _PrefillPlan:
        num_blocks, block_size, owner, plan = self._cached_plan(metadata, kv_cache, self._prefill_plan_cache)
        if plan is not None:
            return plan
        num_decodes = metadata.num_decodes
        tables = metadata.block_tables[num_decodes:metadata.num_reqs].to(device="cpu", dtype=torch.int32).contiguous()
        _validate_tables(tables, metadata.seq_lens_cpu[num_decodes:], num_blocks, block_size, "prefill", num_decodes)
        plan = _PrefillPlan(owner, num_blocks, tables)
        self._prefill_plan_cache = plan if owner is not None else None
        return plan

    def kernel_plan(self, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> _KernelPlan:
        """The decodes' validated tables, lengths and slots of ``metadata``, made once per KV-cache group and
        forward pass (a plan outside a forward context is made per call)."""
        owner = step_context(metadata)
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        for plan in self._kernel_plans:
            if owner is not None and plan.owner is owner and plan.metadata is metadata and plan.num_blocks == num_blocks:
                return plan
        num_decodes = metadata.num_decodes
        lens = metadata.seq_lens_cpu[:num_decodes]
        tables = metadata.block_tables[:num_decodes].to(device="cpu", dtype=torch.int32)
        if tables.dim() != 2 or tables.stride(-1) != 1:
            tables = tables.contiguous()
        if num_decodes:
            _validate_tables(tables, lens, num_blocks, block_size)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        num_threads = self.threads_for(sum(lens))
        ranges = ([] if not num_decodes or (self.kernel is not None and self.kernel.has_openmp)
                  else _balanced_ranges(lens, num_threads))
        plan = _KernelPlan(owner, metadata, num_blocks, tables, seq_lens, num_threads, ranges,
                           _checked_slots(metadata.slot_mapping, num_blocks * block_size))
        if owner is not None:
            self._kernel_plans = [p for p in self._kernel_plans if p.owner is owner
                                  and not (p.metadata is metadata and p.num_blocks == num_blocks)]
            self._kernel_plans.append(plan)
        return plan

    @staticmethod
    def _cached_plan(metadata: AttentionMetadata, kv_cache: torch.Tensor, plan: _PrefillPlan | _KernelPlan | None):
        owner = current_context(metadata)
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        if not (owner is not None and plan is not None and plan.owner is owner and plan.num_blocks == num_blocks):
            plan = None
        return num_blocks, block_size, owner, plan


def _io_tensors(query: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``query`` and ``out`` themselves when contiguous and of one :data:`_IO_DTYPES` dtype, else a float32
    copy and buffer."""
    if query.dtype in _IO_DTYPES and out.dtype == query.dtype and query.is_contiguous() and out.is_contiguous():
        return query, out
    q = query.to(torch.float32).contiguous()
    return q, torch.empty(q.shape, dtype=torch.float32)


def _rows_fit(new: torch.Tensor) -> bool:
    strides = new.stride()
    return len(strides) == 3 and strides[2] == 1 and strides[1] == new.shape[2] and new.is_cpu


def _checked_slots(slot_mapping: torch.Tensor, num_slots: int) -> torch.Tensor | None:
    """The slot mapping as (T,) int64 contiguous CPU when every slot is in the cache, else None."""
    slots = slot_mapping.to(device="cpu", dtype=torch.int64).contiguous()
    if slots.dim() != 1 or (slots.numel() and not (int(slots.min()) >= 0 and int(slots.max()) < num_slots)):
        return None
    return slots


def _scales_fit(kv_scales: torch.Tensor | None, kv_cache: torch.Tensor) -> bool:
    return (kv_scales is not None and kv_scales.dtype == torch.float32 and kv_scales.is_contiguous()
            and tuple(kv_scales.shape) == tuple(kv_cache.shape[:4]) and kv_scales.device == kv_cache.device)


def _run_split(fn, ranges: list[tuple[int, int]], *args) -> None:
    """``fn(*args, begin, end)`` per range, the first on this thread, the others on the pool."""
    first, *rest = ranges
    pool = _get_pool(len(rest)) if rest else None
    futures = [pool.submit(fn, *args, *r) for r in rest] if pool else []
    fn(*args, *first)
    for f in futures:
        f.result()


def _validate_tables(tables: torch.Tensor, lens: list[int], num_blocks: int, block_size: int,
                     kind: str = "decode", first_row: int = 0) -> None:
    """Check that every read stays in the cache (the kernel trusts its inputs). Raises ValueError."""
    max_blocks = tables.shape[1]
    if min(lens) < 1 or max(lens) > max_blocks * block_size:
        raise ValueError(f"{kind} seq_lens must be in [1, {max_blocks * block_size}] (block_tables width "
                         f"{max_blocks} x block_size {block_size}), got min {min(lens)} max {max(lens)}")
    needed = cdiv(max(lens), block_size)
    used = tables[:, :needed]
    # only the blocks a request reads must be valid: padding past its seq_len may be anything
    valid = torch.arange(needed).unsqueeze(0) < cdiv(torch.tensor(lens), block_size).unsqueeze(1)
    bad = valid & ((used < 0) | (used >= num_blocks))
    if bool(bad.any()):
        r, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_tables[{first_row + r}, {i}] = {int(used[r, i])} is outside the KV cache's "
                         f"{num_blocks} blocks")


def _balanced_ranges(lens: list[int], num_parts: int) -> list[tuple[int, int]]:
    """Requests in at most ``num_parts`` contiguous non-empty ranges of about equal total context."""
    num_reqs = len(lens)
    num_parts = max(1, min(num_parts, num_reqs))
    cumulative = list(itertools.accumulate(lens))
    bounds = [0]
    for k in range(1, num_parts):
        end = bisect.bisect_left(cumulative, cumulative[-1] * k / num_parts) + 1
        bounds.append(max(bounds[-1] + 1, min(end, num_reqs - (num_parts - k))))
    bounds.append(num_reqs)
    return list(zip(bounds[:-1], bounds[1:]))
