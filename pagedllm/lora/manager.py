"""The adapter manager of one model runner: adapters known by id, an LRU of loaded ones in host
memory (``max_cpu_loras``), and ``max_loras`` device slots, each layer's :class:`LoRALayer` buffers.

Before a forward, :meth:`LoRAManager.prepare_step` puts the step's adapters into slots (an adapter
already in one stays; the least recently used slot of an adapter this step does not use is reused)
and tells every layer which rows use which slot. The scheduler admits at most ``max_loras``
adapters among running requests, so a step always finds its slots.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagedllm.lora.adapter import LoRAAdapter, LoRAError, LoRAModuleWeights, load_adapter
from pagedllm.lora.layer import LoRABatch, LoRALayer, lora_targets
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger("pagedllm")


class LoRAManager:
    """Attaches a :class:`LoRALayer` to every target projection of ``model`` (``dtype``: the activations')."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype, self.device = dtype, device
        self.targets = lora_targets(model)
        self.batch = LoRABatch()
        modules = dict(model.named_modules())
        self.layers: dict[str, LoRALayer] = {}
        for path in sorted({t.module_path for t in self.targets.values()}):
            layer = LoRALayer(modules[path], max_loras, max_lora_rank, self.batch, dtype, device)
            modules[path].lora = layer
            self.layers[path] = layer
        self.requests: dict[int, LoRARequest] = {}  # every adapter known, by lora_int_id
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # loaded, least recently used first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.free_slots = list(range(max_loras - 1, -1, -1))

    @property
    def slot_bytes(self) -> int:
        """Device bytes of all slots of all layers (allocated at start)."""
        return sum(layer.nbytes for layer in self.layers.values())

    def add_adapter(self, request: LoRARequest) -> bool:
        """Load and check ``request``'s folder and keep it; False when this id is already loaded with the
        same request. Raises LoRAError naming the problem (nothing kept), or for an id another adapter has."""
        known = self.requests.get(request.lora_int_id)
        if known is not None:
            if known != request:
                raise LoRAError(f"lora_int_id {request.lora_int_id} is already adapter {known.lora_name!r}")
            return False
        adapter = load_adapter(request, self.targets, self.max_lora_rank, self.dtype)
        self.requests[request.lora_int_id] = request
        self._keep_in_host(adapter)
        logger.info("LoRA adapter %r (id %d, rank %d, %d projections) loaded from %s", request.lora_name,
                    request.lora_int_id, adapter.rank, len(adapter.modules), request.lora_path)
        return True

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter: host copy and slot freed. False when it was not known."""
        if self.requests.pop(lora_int_id, None) is None:
            return False
        self.host.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.clear_slot(slot)
            self.free_slots.append(slot)
        return True

    def list_adapters(self) -> list[int]:
        return sorted(self.requests)

    def prepare_step(self, token_lora_ids: np.ndarray) -> bool:
        """Slots for the step's adapters and each row's slot (``token_lora_ids`` [T], 0 = base model);
        returns whether any row uses an adapter. RuntimeError when more adapters than slots."""
        ids = [int(i) for i in np.unique(token_lora_ids) if i > 0]
        if not ids:
            self.batch.clear()
            return False
        slots = {i: self._slot_for(i, ids) for i in ids}
        lookup = np.full(int(token_lora_ids.max()) + 1, -1, dtype=np.int64)
        for lora_id, slot in slots.items():
            lookup[lora_id] = slot
        self.batch.set(lookup[token_lora_ids], self.device)
        return True

    def finish_step(self) -> None:
        self.batch.clear()

    def _slot_for(self, lora_int_id: int, step_ids: list[int]) -> int:
        slot = self.slot_of.get(lora_int_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_int_id)
            return slot
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((i for i in self.slot_of if i not in step_ids), None)
            if victim is None:
                raise RuntimeError(f"a step uses more than max_loras={self.max_loras} adapters")
            slot = self.slot_of.pop(victim)
        self._write_slot(slot, self._host_adapter(lora_int_id))
        self.slot_of[lora_int_id] = slot
        return slot

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        parts: dict[str, dict[int | None, LoRAModuleWeights]] = {}
        for hf_path, weights in adapter.modules.items():
            target = self.targets[hf_path]
            parts.setdefault(target.module_path, {})[target.shard] = weights
        for path, layer in self.layers.items():
            if path in parts:
                layer.set_slot(slot, {k: _on(w, self.device) for k, w in parts[path].items()})
            else:
                layer.clear_slot(slot)

    def _host_adapter(self, lora_int_id: int) -> LoRAAdapter:
        """The loaded adapter, read again from its folder if the host LRU dropped it."""
        adapter = self.host.get(lora_int_id)
        if adapter is not None:
            self.host.move_to_end(lora_int_id)
            return adapter
        request = self.requests.get(lora_int_id)
        if request is None:
            raise LoRAError(f"no adapter with lora_int_id {lora_int_id} is loaded")
        adapter = load_adapter(request, self.targets, self.max_lora_rank, self.dtype)
        self._keep_in_host(adapter)
        return adapter

    def _keep_in_host(self, adapter: LoRAAdapter) -> None:
        self.host[adapter.request.lora_int_id] = adapter
        self.host.move_to_end(adapter.request.lora_int_id)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)


def _on(weights: LoRAModuleWeights, device: torch.device) -> LoRAModuleWeights:
    return LoRAModuleWeights(weights.lora_a.to(device), weights.lora_b.to(device))
