"""The batched LoRA op on one projection: the base output untouched, then per adapter slot
``out[rows] += (x[rows] @ A_s^T) @ B_s^T`` over the rows that use it (Punica/S-LoRA's SGMV: a
grouped matmul per adapter; base-model rows cost nothing).

Per slot the slices of a fused projection (q/k/v, gate/up) share one shrink: ``lora_a_t``
(slots, in, n·R) holds each slice's ``A^T`` in its own R columns; each slice j expands from its R
columns of ``h`` with ``lora_b_t[j]`` (slots, R, out_j) into its output columns. R is
``max_lora_rank``; a smaller rank is zero-padded. Many adapters in a step run as batched matmuls
over the slots' rows padded to the longest group (a handful of ops per projection whatever the
number of adapters); a few run slot by slot (an adapter's rows one slice when they are one run).
Under tensor parallelism a column-parallel layer keeps its rows of ``B``, a row-parallel one its
columns of ``A`` (its partial sums join the base's before the one all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tensor_parallel_rank, get_tensor_parallel_size
from pagedllm.lora.adapter import LoRAModuleWeights, LoRATarget
from pagedllm.models.layers.linear import Linear, MergedLinear

# the Hugging Face projections an adapter may target (fused ones through the model's packed_modules)
TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "qkv_proj", "gate_up_proj")


@dataclass
class LoRASegments:
    """The step's runs of consecutive rows under one slot, as device int32 tensors (the Triton path)."""

    starts: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor
    max_length: int


@dataclass
class PaddedRows:
    """The step's LoRA rows laid out for batched matmuls over slots ``[first_slot, first_slot + num_slots)``:
    ``rows`` (their flat-batch indices, sorted by slot) go to ``padded`` positions (slot - first_slot) ·
    ``max_rows`` + their rank in their slot."""

    first_slot: int
    num_slots: int
    max_rows: int
    rows: torch.Tensor
    padded: torch.Tensor


@dataclass
class LoRABatch:
    """Which rows of this step's flat batch use which slot; set by the manager before each forward,
    read by every :class:`LoRALayer`. ``groups``: (slot, rows) with rows a slice when the slot's rows
    are one run, else an index tensor; ``padded``: the same rows for the batched path, when it pays."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    padded: PaddedRows | None = None
    segments: LoRASegments | None = None

    # fewer groups run slot by slot; padding may at most double the rows the batched path computes
    MIN_GROUPS_BATCHED = 4
    MAX_PADDING_FACTOR = 2

    @property
    def has_lora(self) -> bool:
        return bool(self.groups)

    def set(self, token_slots: np.ndarray, device: torch.device, use_segments: bool | None = None) -> None:
        """``token_slots`` [T] int: each row's slot, -1 for the base model. ``use_segments`` (default: on
        CUDA): build the segment tensors, and layers run the Triton kernels."""
        self.clear()
        if token_slots.size == 0 or (token_slots < 0).all():
            return
        change = np.flatnonzero(np.diff(token_slots)) + 1
        starts = np.concatenate([[0], change])
        ends = np.concatenate([change, [token_slots.size]])
        slots = token_slots[starts]
        keep = slots >= 0
        starts, ends, slots = starts[keep], ends[keep], slots[keep]
        for slot in np.unique(slots):
            mine = slots == slot
            if mine.sum() == 1:
                self.groups.append((int(slot), slice(int(starts[mine][0]), int(ends[mine][0]))))
            else:
                rows = np.concatenate([np.arange(s, e) for s, e in zip(starts[mine], ends[mine])])
                self.groups.append((int(slot), torch.from_numpy(rows).to(device)))
        if device.type == "cuda" if use_segments is None else use_segments:
            as_tensor = lambda a: torch.from_numpy(a.astype(np.int32)).to(device)  # noqa: E731
            self.segments = LoRASegments(as_tensor(starts), as_tensor(ends - starts), as_tensor(slots),
                                         int((ends - starts).max()))
        else:
            self.padded = _padded_rows(token_slots, len(self.groups), device, self.MIN_GROUPS_BATCHED,
                                       self.MAX_PADDING_FACTOR)

    def clear(self) -> None:
        self.groups, self.padded, self.segments = [], None, None


def _padded_rows(token_slots: np.ndarray, num_groups: int, device: torch.device, min_groups: int,
                 max_padding: int) -> PaddedRows | None:
    """The batched layout, or None when too few groups or too much padding (slot by slot is cheaper)."""
    if num_groups < min_groups:
        return None
    rows = np.flatnonzero(token_slots >= 0)
    rows = rows[np.argsort(token_slots[rows], kind="stable")]
    slots = token_slots[rows]
    first, last = int(slots[0]), int(slots[-1])
    counts = np.bincount(slots - first, minlength=last - first + 1)
    max_rows = int(counts.max())
    if (last - first + 1) * max_rows > max_padding * rows.size:
        return None
    rank_in_slot = np.arange(rows.size) - np.concatenate([[0], np.cumsum(counts)[:-1]])[slots - first]
    padded = (slots - first) * max_rows + rank_in_slot
    return PaddedRows(first, last - first + 1, max_rows, torch.from_numpy(rows).to(device),
                      torch.from_numpy(padded).to(device))


class LoRALayer:
    """The adapter slots of one projection ``base`` (attached as ``base.lora``; ``Linear.forward``
    calls :meth:`apply` on its output). Slots are zero until :meth:`set_slot`."""

    def __init__(self, base: Linear, num_slots: int, max_rank: int, batch: LoRABatch, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.base_sizes = list(base.output_sizes) if isinstance(base, MergedLinear) else [base.out_features]
        self.max_rank = max_rank
        self.batch = batch
        n = len(self.base_sizes)
        self.lora_a_t = torch.zeros(num_slots, base.in_features, n * max_rank, dtype=dtype, device=device)
        self.lora_b_t = [torch.zeros(num_slots, max_rank, size, dtype=dtype, device=device) for size in self.base_sizes]
        self.offsets = np.concatenate([[0], np.cumsum(self.base_sizes)]).tolist()
        self.full_sizes = list(getattr(base, "full_sizes", self.base_sizes))
        self.ranges = list(getattr(base, "ranges", [(0, s) for s in self.base_sizes]))
        self.is_row_parallel = bool(getattr(base, "input_is_parallel", False))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lora_a_t, *self.lora_b_t))

    def set_slot(self, slot: int, parts: dict[int | None, LoRAModuleWeights]) -> None:
        """Write an adapter's slices into ``slot`` (key: slice index, None for the whole fused projection:
        its A shrinks for every slice, each expanding with its rows of B)."""
        self.clear_slot(slot)
        for shard, weights in parts.items():
            r, a = weights.rank, self._local_a(weights.lora_a).t()
            if shard is None:
                b_parts = weights.lora_b.split(self.full_sizes, dim=0)
                slices = range(len(self.base_sizes))
            else:
                b_parts, slices = {shard: weights.lora_b}, [shard]
            for j in slices:
                start, rows = self.ranges[j]
                self.lora_a_t[slot, :, j * self.max_rank:j * self.max_rank + r] = a
                self.lora_b_t[j][slot, :r] = b_parts[j].narrow(0, start, rows).t()  # this rank's rows

    def clear_slot(self, slot: int) -> None:
        self.lora_a_t[slot].zero_()
        for b in self.lora_b_t:
            b[slot].zero_()

    def _local_a(self, a: torch.Tensor) -> torch.Tensor:
        """(r, in) -> this rank's input columns (row-parallel), else all of them."""
        if not self.is_row_parallel or get_tensor_parallel_size() == 1:
            return a
        cols = self.lora_a_t.shape[1]
        return a.narrow(1, get_tensor_parallel_rank() * cols, cols)

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (T, out) += each LoRA row's adapter contribution, in place; x (T, in)."""
        batch = self.batch
        if not batch.has_lora:
            return out
        if batch.segments is not None:
            from pagedllm.lora.triton_sgmv import sgmv_add

            for j, b_t in enumerate(self.lora_b_t):
                r = slice(j * self.max_rank, (j + 1) * self.max_rank)
                sgmv_add(x, out[:, self.offsets[j]:self.offsets[j + 1]], self.lora_a_t[:, :, r], b_t, batch.segments)
            return out
        x = x.to(self.lora_a_t.dtype)
        if batch.padded is not None:
            return self._apply_padded(x, out, batch.padded)
        return sgmv_add_torch(x, out, self.lora_a_t, self.lora_b_t, self.offsets, batch.groups)

    def _apply_padded(self, x: torch.Tensor, out: torch.Tensor, p: PaddedRows) -> torch.Tensor:
        """The batched path: rows gathered into (slots, max_rows, in), one bmm shrink, one bmm expand per slice."""
        x_pad = x.new_zeros(p.num_slots * p.max_rows, x.shape[1])
        x_pad[p.padded] = x.index_select(0, p.rows)
        slots = slice(p.first_slot, p.first_slot + p.num_slots)
        h = torch.bmm(x_pad.view(p.num_slots, p.max_rows, -1), self.lora_a_t[slots])  # (S, M, n·R)
        for j, b_t in enumerate(self.lora_b_t):
            y = torch.bmm(h[:, :, j * self.max_rank:(j + 1) * self.max_rank], b_t[slots])  # (S, M, out_j)
            out[:, self.offsets[j]:self.offsets[j + 1]].index_add_(0, p.rows, y.flatten(0, 1).index_select(0, p.padded))
        return out


def sgmv_add_torch(x: torch.Tensor, out: torch.Tensor, lora_a_t: torch.Tensor, lora_b_t: list[torch.Tensor],
                   offsets: list[int], groups: list[tuple[int, slice | torch.Tensor]]) -> torch.Tensor:
    """The grouped matmul in torch, slot by slot: its rows' shrink ``x @ A^T``, then per output slice j the
    expand ``@ B_j^T`` added into its columns of ``out`` (in place; rows as one slice need no gather)."""
    rank = lora_b_t[0].shape[1]
    for slot, rows in groups:
        if isinstance(rows, slice):
            h = x[rows] @ lora_a_t[slot]
            for j, b_t in enumerate(lora_b_t):
                out[rows, offsets[j]:offsets[j + 1]].addmm_(h[:, j * rank:(j + 1) * rank], b_t[slot])
        else:
            h = x.index_select(0, rows) @ lora_a_t[slot]
            for j, b_t in enumerate(lora_b_t):
                out[:, offsets[j]:offsets[j + 1]].index_add_(0, rows, h[:, j * rank:(j + 1) * rank] @ b_t[slot])
    return out


def lora_targets(model: nn.Module) -> dict[str, LoRATarget]:
    """Every projection of ``model`` an adapter may target, by Hugging Face module path, full shapes."""
    packed = getattr(model, "packed_modules", {})
    parts_of: dict[str, list[tuple[str, int]]] = {}
    for leaf, (fused, shard) in packed.items():
        parts_of.setdefault(fused, []).append((leaf, shard))
    targets = {}
    for path, module in model.named_modules():
        leaf = path.rpartition(".")[2]
        if not isinstance(module, Linear) or leaf not in TARGET_NAMES:
            continue
        in_full = module.in_features * (get_tensor_parallel_size() if getattr(module, "input_is_parallel", False)
                                        else 1)
        full_sizes = list(getattr(module, "full_sizes", getattr(module, "output_sizes", [module.out_features])))
        targets[path] = LoRATarget(path, None, in_full, sum(full_sizes))
        parent = path.rpartition(".")[0]
        for part, shard in parts_of.get(leaf, []):
            targets[f"{parent}.{part}"] = LoRATarget(path, shard, in_full, full_sizes[shard])
    return targets
