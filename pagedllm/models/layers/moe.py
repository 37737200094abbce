"""Mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE): top-k routing (Shazeer et al., 2017), softmax
in float32, optionally renormalized; experts run on their routed tokens, sorted by expert once. Parameters
in transformers' fused layout: ``experts.gate_up_proj`` (E, 2I, H), gate rows first, ``experts.down_proj``
(E, H, I). Tensor parallelism splits every expert's I (vLLM's ``FusedMoE``); the router is replicated."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.communication import all_reduce
from pagedllm.distributed.parallel_state import get_tensor_parallel_rank, get_tensor_parallel_size
from pagedllm.models.layers.activation import gated_activation, get_activation
from pagedllm.models.layers.linear import Linear

_EXPERT_PARTS = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0),
                 "w3": ("gate_up_proj", 1), "up_proj": ("gate_up_proj", 1),
                 "w2": ("down_proj", None), "down_proj": ("down_proj", None)}


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits (T, num_experts) -> weights (T, top_k) float32, expert ids (T, top_k) int64."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # (T, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoEExperts(nn.Module):
    """``num_experts`` SwiGLU experts as stacked tensors, this rank's ``intermediate_size / N`` of each.
    ValueError naming ``tensor_parallel_size`` when N does not divide ``intermediate_size``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        tp = get_tensor_parallel_size()
        if intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the experts' intermediate size {intermediate_size}")
        self.num_experts, self.full_intermediate_size = num_experts, intermediate_size
        self.intermediate_size = intermediate_size // tp
        self.act = get_activation(activation)  # validates the name
        self.activation = activation
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_size))

    def expert_weight(self, expert: int, part: str) -> torch.Tensor:
        """The view of expert ``expert``'s ``part``. Raises ValueError for an unknown part or expert."""
        if part not in _EXPERT_PARTS or not 0 <= expert < self.num_experts:
            raise ValueError(f"no expert weight {part!r} for expert {expert} (experts 0..{self.num_experts - 1}; "
                             f"parts {', '.join(_EXPERT_PARTS)})")
        fused, half = _EXPERT_PARTS[part]
        param = getattr(self, fused)[expert]
        return param if half is None else param.narrow(0, half * self.intermediate_size, self.intermediate_size)

    def expert_slice(self, tensor: torch.Tensor, part: str) -> torch.Tensor:
        """This rank's part of one expert's matrix (gate/up: rows, down: columns); ValueError for another shape."""
        down = _EXPERT_PARTS[part][1] is None
        hidden = self.down_proj.shape[1]
        full = (hidden, self.full_intermediate_size) if down else (self.full_intermediate_size, hidden)
        if tuple(tensor.shape) != full:
            raise ValueError(f"has shape {tuple(tensor.shape)}, expected {full}")
        return tensor.narrow(1 if down else 0, get_tensor_parallel_rank() * self.intermediate_size,
                             self.intermediate_size)

    def checkpoint_slice(self, tensor: torch.Tensor, param_name: str, shard: int | None) -> torch.Tensor:
        """This rank's part of the fused ``gate_up_proj`` (E, 2I, H) or ``down_proj`` (E, H, I)."""
        hidden, n, rank = self.down_proj.shape[1], self.intermediate_size, get_tensor_parallel_rank()
        if param_name == "down_proj":
            expected = (self.num_experts, hidden, self.full_intermediate_size)
        else:
            expected = (self.num_experts, 2 * self.full_intermediate_size, hidden)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"has shape {tuple(tensor.shape)}, expected {expected}")
        if param_name == "down_proj":
            return tensor.narrow(2, rank * n, n)
        gate, up = tensor.chunk(2, dim=1)
        return torch.cat([gate.narrow(1, rank * n, n), up.narrow(1, rank * n, n)], dim=1)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """x (T, hidden), weights (T, k) float32, expert_ids (T, k) int64 -> (T, hidden)."""
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.reshape(-1)  # (T*k,) pair p = token p // k, its (p % k)-th expert
        order = torch.argsort(flat_ids, stable=True)
        # host copy of the group sizes: one sync per layer
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        tokens = order // top_k  # (T*k,) token of each sorted pair
        hidden = x.index_select(0, tokens)  # (T*k, hidden)
        out = torch.empty_like(hidden)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            gate_up = F.linear(hidden[start:start + n], self.gate_up_proj[e])  # (n, 2I)
            out[start:start + n] = F.linear(gated_activation(gate_up, self.activation), self.down_proj[e])
            start += n
        out = (out.float() * weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)  # (T*k, hidden)
        return torch.zeros_like(x).index_add_(0, tokens, out)


class FusedMoE(nn.Module):
    """Router + experts: x (T, hidden) -> (T, hidden). Raises ValueError for a bad ``top_k`` or activation."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, activation: str,
                 renormalize: bool) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts} (num_experts), got {top_k}")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        return all_reduce(self.experts(x, weights, ids))


_EXPERT_WEIGHT = re.compile(r"(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight")


class MoEWeightsMixin:
    """Weight loading for a family whose MLPs are :class:`FusedMoE` (first among the bases); ``module_aliases``
    renames a checkpoint's module (Mixtral's ``block_sparse_moe``)."""

    module_aliases: dict[str, str] = {}
    expert_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    def _canonical_name(self, name: str) -> str:
        for old, new in self.module_aliases.items():
            name = name.replace(f".{old}.", f".{new}.")
        return name

    def _weight_target(self, name: str, tensor: torch.Tensor, params: dict,
                       modules: dict) -> tuple[torch.Tensor, torch.Tensor]:
        name = self._canonical_name(name)
        match = _EXPERT_WEIGHT.fullmatch(name)
        if match and isinstance(modules.get(match["experts"]), MoEExperts):
            experts, part = modules[match["experts"]], match["part"]
            target = experts.expert_weight(int(match["expert"]), part)
            try:
                return target, experts.expert_slice(tensor, part)
            except ValueError as e:
                raise ValueError(f"weight {name!r} {e}") from None
        return super()._weight_target(name, tensor, params, modules)

    def _missing_weights(self, modules: dict, loaded: set[str]) -> list[str]:
        loaded = {self._canonical_name(n) for n in loaded}
        missing = []
        for path, module in modules.items():
            if not isinstance(module, MoEExperts):
                continue
            gate, up, down = self.expert_parts
            for fused, parts in (("gate_up_proj", (gate, up)), ("down_proj", (down,))):
                if f"{path}.{fused}" in loaded:
                    continue
                # an expert's matrix counts as given under any of its names (GGUF gives gate_proj...)
                missing += [f"{path}.{e}.{part}.weight" for e in range(module.num_experts) for part in parts
                            if not any(f"{path}.{e}.{alias}.weight" in loaded for alias in _aliases(part))]
                loaded.add(f"{path}.{fused}")
        return sorted(super()._missing_weights(modules, loaded) + missing)


def _aliases(part: str) -> list[str]:
    """Every per-expert name of the matrix ``part`` names (``w1`` and ``gate_proj``, ...)."""
    return [name for name, target in _EXPERT_PARTS.items() if target == _EXPERT_PARTS[part]]
