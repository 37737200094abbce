"""PEFT adapter folders (``adapter_config.json`` + ``adapter_model.safetensors``) read and checked
against the base model's projections, before any of it reaches a slot.

A LoRA adds ``scaling · B A x`` to a projection ``W x`` (Hu et al., 2021): ``A`` (r, in), ``B`` (out, r),
``scaling = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora`` (Kalajdzievski, 2023).
The scaling is folded into ``B`` here, once. Every problem is a :class:`LoRAError` naming it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from pagedllm.lora.request import LoRAError, LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRATarget:
    """One Hugging Face projection an adapter may target: the pagedllm module holding it, which slice
    of a fused module (None: all of it), and its full (unsharded) shape."""

    module_path: str
    shard: int | None
    in_features: int
    out_features: int


@dataclass
class LoRAModuleWeights:
    """One projection's adapter: ``lora_a`` (r, in), ``lora_b`` (out, r) with the scaling folded in."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class LoRAAdapter:
    """A loaded adapter: its request and its projections by Hugging Face module path."""

    request: LoRARequest
    rank: int
    scaling: float
    modules: dict[str, LoRAModuleWeights]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for m in self.modules.values() for t in (m.lora_a, m.lora_b))


def read_adapter_config(path: str) -> dict:
    """The folder's ``adapter_config.json`` checked for what the engine serves; LoRAError otherwise."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoRAError(f"lora_path {path!r} is not a folder")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"lora_path {path!r} has no {CONFIG_FILE}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"{CONFIG_FILE} in {path!r} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{CONFIG_FILE} in {path!r} must be a JSON object")
    _check_config(config)
    return config


def _check_config(config: dict) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"adapter_config.json peft_type must be LORA, got {config.get('peft_type')!r}")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoRAError(f"adapter_config.json r must be an integer >= 1, got {r!r}")
    alpha = config.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAError(f"adapter_config.json lora_alpha must be a number, got {alpha!r}")
    for key in ("fan_in_fan_out", "use_dora", "modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoRAError(f"adapter_config.json {key}={config[key]!r} is not supported")
    if config.get("bias", "none") not in (None, "none"):
        raise LoRAError(f"adapter_config.json bias={config['bias']!r} is not supported (only 'none')")


def adapter_scaling(config: dict) -> float:
    """``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` when ``use_rslora``."""
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def load_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_lora_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """Read and check ``request.lora_path`` against the base model's ``targets``; tensors on the CPU in
    ``dtype`` (the activation dtype, also over a quantized base). Raises LoRAError naming the problem."""
    config = read_adapter_config(request.lora_path)
    rank = config["r"]
    if rank > max_lora_rank:
        raise LoRAError(f"adapter {request.lora_name!r} has rank r={rank}, above max_lora_rank={max_lora_rank}")
    tensors = _read_tensors(request.lora_path)
    scaling = adapter_scaling(config)
    modules = {}
    for hf_path, (a, b) in _pair_tensors(tensors).items():
        target = targets.get(hf_path)
        if target is None:
            raise LoRAError(f"adapter {request.lora_name!r} targets {hf_path!r}, which the base model has no "
                            f"LoRA-capable projection for")
        _check_shapes(hf_path, a, b, target, rank)
        modules[hf_path] = LoRAModuleWeights(a.to(dtype).contiguous(), (b.double() * scaling).to(dtype).contiguous())
    if not modules:
        raise LoRAError(f"adapter {request.lora_name!r} has no lora_A/lora_B tensors in {WEIGHTS_FILE}")
    return LoRAAdapter(request, rank, scaling, modules)


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise LoRAError(f"lora_path {path!r} has no {WEIGHTS_FILE}")
    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAError(f"{WEIGHTS_FILE} in {path!r} cannot be read: {e}") from None


def _pair_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{hf module path: (lora_A, lora_B)}``; LoRAError for a tensor of another kind or half a pair."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        stem = name.removeprefix(_PREFIX)
        for kind in ("lora_A", "lora_B"):
            suffix = f".{kind}.weight"
            if stem.endswith(suffix):
                halves.setdefault(stem[:-len(suffix)], {})[kind] = tensor
                break
        else:
            raise LoRAError(f"{WEIGHTS_FILE} holds {name!r}: only lora_A/lora_B weights are supported "
                            f"(no biases, embeddings or saved modules)")
    pairs = {}
    for path, pair in halves.items():
        missing = [k for k in ("lora_A", "lora_B") if k not in pair]
        if missing:
            raise LoRAError(f"{WEIGHTS_FILE} is missing {path}.{missing[0]}.weight")
        pairs[path] = (pair["lora_A"], pair["lora_B"])
    return pairs


def _check_shapes(hf_path: str, a: torch.Tensor, b: torch.Tensor, target: LoRATarget, rank: int) -> None:
    expected_a, expected_b = (rank, target.in_features), (target.out_features, rank)
    if tuple(a.shape) != expected_a:
        raise LoRAError(f"{hf_path}.lora_A.weight has shape {tuple(a.shape)}, expected {expected_a} "
                        f"(r, in_features of the base projection)")
    if tuple(b.shape) != expected_b:
        raise LoRAError(f"{hf_path}.lora_B.weight has shape {tuple(b.shape)}, expected {expected_b} "
                        f"(out_features of the base projection, r)")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise LoRAError(f"{hf_path}: lora_A/lora_B must be floating point, got {a.dtype} and {b.dtype}")
