"""The batched LoRA op on one projection: the base output untouched, then per adapter slot
``out[rows] += (x[rows] @ A_s^T) @ B_s^T`` over the rows that use it (Punica/S-LoRA's SGMV: a
grouped matmul per adapter; base-model rows cost nothing).

Per slot the adapter of every slice of a fused projection (q/k/v, gate/up) is one block layout:
``lora_a_t`` (slots, in, n·R) holds each slice's ``A^T`` in its own R columns, ``lora_b_t``
(slots, n·R, out) each slice's ``B^T`` in its R rows and its output columns (zeros elsewhere), so a
slot is two matmuls whatever the fusion. R is ``max_lora_rank``; a smaller rank is zero-padded.
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
class LoRABatch:
    """Which rows of this step's flat batch use which slot; set by the manager before each forward,
    read by every :class:`LoRALayer`. ``groups``: (slot, rows) with rows a slice when the slot's rows
    are one run, else an index tensor."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    segments: LoRASegments | None = None

    @property
    def has_lora(self) -> bool:
        return bool(self.groups)

    def set(self, token_slots: np.ndarray, device: torch.device, use_segments: bool | None = None) -> None:
        """``token_slots`` [T] int: each row's slot, -1 for the base model. ``use_segments`` (default: on
        CUDA): build the segment tensors, and layers run the Triton kernels."""
        self.groups, self.segments = [], None
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

    def clear(self) -> None:
        self.groups, self.segments = [], None


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
        self.lora_b_t = torch.zeros(num_slots, n * max_rank, base.out_features, dtype=dtype, device=device)
        self.full_sizes = list(getattr(base, "full_sizes", self.base_sizes))
        self.ranges = list(getattr(base, "ranges", [(0, s) for s in self.base_sizes]))
        self.is_row_parallel = bool(getattr(base, "input_is_parallel", False))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lora_a_t, self.lora_b_t))

    def set_slot(self, slot: int, parts: dict[int | None, LoRAModuleWeights]) -> None:
        """Write an adapter's slices into ``slot`` (key: slice index, None for the whole fused projection)."""
        self.lora_a_t[slot].zero_()
        self.lora_b_t[slot].zero_()
        offsets = np.concatenate([[0], np.cumsum(self.base_sizes)]).tolist()
        for shard, weights in parts.items():
            j = 0 if shard is None else shard
            cols = slice(j * self.max_rank, j * self.max_rank + weights.rank)
            self.lora_a_t[slot, :, cols] = self._local_a(weights.lora_a).t()
            if shard is None:
                self.lora_b_t[slot, cols, :] = self._local_b_whole(weights.lora_b).t()
            else:
                start, rows = self.ranges[shard]
                b = weights.lora_b.narrow(0, start, rows)  # this rank's rows (out_local, r)
                self.lora_b_t[slot, cols, offsets[shard]:offsets[shard + 1]] = b.t()

    def clear_slot(self, slot: int) -> None:
        self.lora_a_t[slot].zero_()
        self.lora_b_t[slot].zero_()

    def _local_a(self, a: torch.Tensor) -> torch.Tensor:
        """(r, in) -> this rank's input columns (row-parallel), else all of them."""
        if not self.is_row_parallel or get_tensor_parallel_size() == 1:
            return a
        cols = self.lora_a_t.shape[1]
        return a.narrow(1, get_tensor_parallel_rank() * cols, cols)

    def _local_b_whole(self, b: torch.Tensor) -> torch.Tensor:
        """A fused projection's whole (out_full, r) ``B`` -> this rank's rows of every slice, stacked."""
        parts = b.split(self.full_sizes, dim=0)
        return torch.cat([p.narrow(0, s, n) for p, (s, n) in zip(parts, self.ranges)], dim=0)

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (T, out) += each LoRA row's adapter contribution, in place; x (T, in)."""
        batch = self.batch
        if not batch.has_lora:
            return out
        if batch.segments is not None:
            from pagedllm.lora.triton_sgmv import sgmv_add

            sgmv_add(x, out, self.lora_a_t, self.lora_b_t, batch.segments)
            return out
        return sgmv_add_torch(x, out, self.lora_a_t, self.lora_b_t, batch.groups)


def sgmv_add_torch(x: torch.Tensor, out: torch.Tensor, lora_a_t: torch.Tensor, lora_b_t: torch.Tensor,
                   groups: list[tuple[int, slice | torch.Tensor]]) -> torch.Tensor:
    """The grouped matmul in torch: per slot, its rows' shrink ``x @ A^T`` then expand ``@ B^T`` added
    into ``out`` (in place; a slot's rows as one slice need no gather)."""
    x = x.to(lora_a_t.dtype)
    for slot, rows in groups:
        if isinstance(rows, slice):
            out[rows].addmm_(x[rows] @ lora_a_t[slot], lora_b_t[slot])
        else:
            out.index_add_(0, rows, (x.index_select(0, rows) @ lora_a_t[slot]) @ lora_b_t[slot])
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
