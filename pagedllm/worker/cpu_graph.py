"""CPU decode graphs: a decode step's C-kernel calls recorded once per batch size, then replayed without
the Python around them (bitwise the eager outputs). docs/engine.md, "CPU decode graphs"."""

from __future__ import annotations

import logging
import math
import weakref
from collections import OrderedDict

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.models.layers.linear import packing_generation
from pagedllm.ops import graph_replay
from pagedllm.ops.recording import Recording, recording

logger = logging.getLogger("pagedllm")

__all__ = ["CpuDecodeGraphs", "DEFAULT_MAX_GRAPHS"]

DEFAULT_MAX_GRAPHS = 4
_aten = torch.ops.aten
# ops that allocate or view, computing nothing: a recorded pass may run them freely
_NO_COMPUTE_OPS = frozenset({
    _aten.empty, _aten.empty_strided, _aten.empty_like, _aten.view, _aten._unsafe_view, _aten.slice, _aten.select,
    _aten.split, _aten.split_with_sizes, _aten.t, _aten.transpose, _aten.as_strided, _aten.unsqueeze, _aten.squeeze,
    _aten.detach, _aten.alias, _aten.permute, _aten.expand, _aten.narrow, _aten.unbind, _aten.lift_fresh,
})
_profiling = torch._C._autograd._profiler_enabled


def _computes_nothing(func, args: tuple, out) -> bool:
    packet = func.overloadpacket
    if packet in _NO_COMPUTE_OPS:
        return True
    return (packet is _aten.reshape and isinstance(out, torch.Tensor) and bool(args)
            and _storage(out) is not None and _storage(out) == _storage(args[0]))


class _ArenaPool:
    """Memory for a recorded pass's allocations, owned while the graph lives and reused within the pass
    as eager reuses freed memory; replays keep the call order, so a block is overwritten only after the
    calls reading its previous contents."""

    ALIGN = 64

    def __init__(self) -> None:
        self.blocks: list[np.ndarray] = []
        self.free: dict[int, list[int]] = {}  # block bytes -> indices of free blocks, latest last
        self.owned: dict[int, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def empty(self, size: list[int], dtype: torch.dtype) -> torch.Tensor | None:
        nbytes = math.prod(size) * dtype.itemsize
        if nbytes == 0:
            return None
        rounded = -(-nbytes // self.ALIGN) * self.ALIGN
        free = self.free.get(rounded)
        if free:
            index = free.pop()
        else:
            base = np.empty(rounded + self.ALIGN, dtype=np.uint8)
            offset = -base.ctypes.data % self.ALIGN
            self.blocks.append(base[offset:offset + rounded])
            index = self.owned[self.blocks[-1].ctypes.data] = len(self.blocks) - 1
        view = self.blocks[index][:nbytes]
        weakref.finalize(view, self.free.setdefault(rounded, []).append, index)
        return torch.from_numpy(view).view(dtype).view(size)

    def alias(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, or for a view of a pool block the same view without keeping the block in use."""
        storage = _storage(t)
        index = self.owned.get(storage[0]) if storage is not None else None
        if index is None:
            return t
        flat = torch.from_numpy(self.blocks[index][:storage[1]]).view(t.dtype)
        return flat.as_strided(t.shape, t.stride(), t.storage_offset())


class _CaptureGuard(TorchDispatchMode):
    """Serves the wrappers' allocations from ``pool`` and keeps every other tensor of the pass."""

    def __init__(self, rec: Recording, pool: _ArenaPool) -> None:
        super().__init__()
        self.rec, self.pool = rec, pool
        self.refused_by: str | None = None
        self.storages: dict[int, int] = {}  # data pointer -> bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten.empty.memory_format and self.rec.allowed_depth == 0 and _is_plain_empty(kwargs):
            out = self.pool.empty(args[0], kwargs.get("dtype") or torch.get_default_dtype())
            if out is not None:
                return out
        out = func(*args, **kwargs)
        if self.rec.allowed_depth == 0 and self.refused_by is None and not _computes_nothing(func, args, out):
            self.refused_by = str(func)
        if self.rec.allowed_depth > 0:
            return out
        inputs = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = _storage(t)
                if storage is not None and storage[0] in self.pool.owned:
                    continue
                self.rec.keep.append(t)
                if storage is not None and storage not in inputs:
                    self.storages[storage[0]] = storage[1]
        return out


def _is_plain_empty(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return (kwargs.get("layout") in (None, torch.strided) and (device is None or torch.device(device).type == "cpu")
            and kwargs.get("memory_format") in (None, torch.contiguous_format) and not kwargs.get("pin_memory"))


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of a strided tensor's storage; None for one without (oneDNN's packed weights)."""
    if t.layout != torch.strided or t.is_mkldnn:
        return None
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class _Graph:
    """One recorded pass; ``program``: its native replay (None: replayed from Python)."""

    def __init__(self, rec: Recording, pool: _ArenaPool, hidden: torch.Tensor, cos_sin: dict[str, torch.Tensor],
                 out: torch.Tensor, program: graph_replay.Program | None) -> None:
        self.rec, self.pool, self.hidden, self.cos_sin, self.out = rec, pool, hidden, cos_sin, out
        self.program = program

    def replay(self, hidden: torch.Tensor, cos_sin: dict[str, torch.Tensor]) -> bool:
        """Writes the pass's output into ``self.out``; True when the native program ran it."""
        self.hidden.copy_(hidden)
        for key, rows in cos_sin.items():
            self.cos_sin[key].copy_(rows)
        if self.program is not None and self.program.refresh():
            self.program.run()
            return True
        self.rec.replay()
        return False


class CpuDecodeGraphs:
    """Decode-only forward passes of ``model`` recorded and replayed per (rows, threads), at most
    ``max_graphs`` (LRU). ``refused`` maps a size to the op that refused its capture."""

    def __init__(self, model: torch.nn.Module, max_graphs: int = DEFAULT_MAX_GRAPHS) -> None:
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.model = model
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()
        self.refused: dict[tuple[int, int], str] = {}
        self.num_captured = 0
        self.num_replayed = 0
        self.num_replayed_native = 0
        self._last_key: tuple[int, int] | None = None
        self._generation = packing_generation()
        self._eager = False  # a repacking left some decoder linear without its skinny weight

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Whether ``model`` has the split forward and every decoder linear runs the skinny GEMM or a weight
        format whose decode rows are one recorded kernel call (``records_cpu_graphs``; other torch ops in a
        captured pass still refuse it)."""
        from pagedllm.models.layers.linear import Linear

        inner = getattr(model, "model", None)
        if not (callable(getattr(model, "rope_rows", None)) and callable(getattr(inner, "forward_layers", None))
                and hasattr(inner, "embed_tokens")):
            return False
        linears = [m for m in inner.modules() if isinstance(m, Linear)]
        return bool(linears) and all(getattr(m.quant_method, "records_cpu_graphs", False) if m.quant_method is not None
                                     else m.skinny_weight is not None for m in linears)

    @staticmethod
    def can_run(metas: list[AttentionMetadata | None]) -> bool:
        return (bool(metas) and all(m is not None and m.num_decodes == m.num_reqs for m in metas)
                and not _profiling())

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states (T, hidden) of a decode-only step: replayed if this size was captured,
        captured on its second consecutive step, else eager. A repacked linear drops every graph first."""
        if packing_generation() != self._generation:
            self.clear()
            self._generation = packing_generation()
            self._eager = not self.supports(self.model)
        key = (int(input_ids.shape[0]), torch.get_num_threads())
        hidden = self.model.model.embed_tokens(input_ids)
        cos_sin = self.model.rope_rows(positions)
        if self._eager:
            return self.model.model.forward_layers(hidden, cos_sin)
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            self.num_replayed += 1
            self.num_replayed_native += graph.replay(hidden, cos_sin)
            return graph.out.clone()  # the next replay overwrites graph.out
        if key == self._last_key and key not in self.refused:
            return self._capture(key, hidden, cos_sin)
        self._last_key = key
        return self.model.model.forward_layers(hidden, cos_sin)

    def clear(self) -> None:
        """Drop every graph and refusal (after weights or caches change)."""
        self.graphs.clear()
        self.refused.clear()
        self._last_key = None

    def _capture(self, key: tuple[int, int], hidden: torch.Tensor, cos_sin: dict[str, torch.Tensor]) -> torch.Tensor:
        cos_sin = {k: v.clone() for k, v in cos_sin.items()}  # a lookup may be a view of its table
        pool = _ArenaPool()
        rec = Recording(empty=pool.empty, alias=pool.alias)
        guard = _CaptureGuard(rec, pool)
        with recording(rec), guard:
            out = self.model.model.forward_layers(hidden, cos_sin)
        if guard.refused_by is not None:
            self.refused[key] = guard.refused_by
            logger.debug("CPU decode graph for %d rows, %d threads: stays eager (%s)", *key, guard.refused_by)
            return out
        program = (graph_replay.Program(rec, key[1]) if rec.tasks is not None and graph_replay.available() else None)
        self.graphs[key] = _Graph(rec, pool, hidden, cos_sin, out, program)
        self.num_captured += 1
        logger.debug("CPU decode graph for %d rows, %d threads: %d calls (%s replay), %.1f MiB of activations kept",
                     *key, len(rec.calls), "native" if program else f"Python; without a task form: {rec.untasked}",
                     (pool.nbytes + sum(guard.storages.values())) / 2**20)
        if len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return out.clone()
