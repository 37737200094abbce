"""Rotary position embeddings (Su et al., 2021, "RoFormer"), neox style. ``default``: ``1 / theta **
(2i / rotary_dim)``; the scaled types use transformers' ``ROPE_INIT_FUNCTIONS`` (``dynamic`` unscaled: a
served sequence never passes ``max_position_embeddings``); ``longrope`` is refused."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """``config``'s rotary parameters (for ``layer_type``) as one dict with ``rope_type`` and ``rope_theta``.
    Raises ValueError for a rope type not in :data:`SUPPORTED_ROPE_TYPES`."""
    params = getattr(config, "rope_parameters", None)
    if params and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    params["rope_type"] = rope_type
    return params


def rope_inv_freq(config: Any, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (rotary_dim // 2,) float32 and the cos/sin scale (attention factor)."""
    params = rope_parameters(config, layer_type)
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
    rotary_dim = int(head_dim * partial)
    if params["rope_type"] == "default":
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (float(params["rope_theta"]) ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    nested = layer_type is not None and isinstance((getattr(config, "rope_parameters", None) or {}).get(layer_type),
                                                   dict)
    kwargs = {"layer_type": layer_type} if nested else {}
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """The cos/sin table ``cos_sin`` (max_positions, 2, rotary_dim) in the model dtype, row p ``cat(cos, cos)``
    and ``cat(-sin, sin)`` of ``p * inv_freq`` (transformers' ``rotate_half`` on the first ``rotary_dim`` features)."""

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())  # (max_positions, rotary_dim // 2)
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], 1)  # (max_pos, 2, rotary_dim)
        self.register_buffer("cos_sin", table.to(dtype=dtype, device=device), persistent=False)
        self.max_positions = max_positions

    @classmethod
    def from_config(cls, config: Any, head_dim: int, max_positions: int, dtype: torch.dtype, device: torch.device,
                    layer_type: str | None = None) -> "RotaryEmbedding":
        inv_freq, attention_factor = rope_inv_freq(config, head_dim, layer_type)
        return cls(inv_freq, attention_factor, max_positions, dtype, device)

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """positions: (T,) int64 in [0, max_positions) -> (T, 2, rotary_dim) cos/sin rows."""
        return self.cos_sin.index_select(0, positions)

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """Rotate x: (T, num_heads, head_dim) by cos_sin: (T, 2, rotary_dim) -> (T, num_heads, head_dim)."""
        rotary_dim = cos_sin.shape[-1]
        if rotary_dim < x.shape[-1]:
            rot, rest = x.split([rotary_dim, x.shape[-1] - rotary_dim], dim=-1)
            return torch.cat([RotaryEmbedding.apply(rot, cos_sin), rest], dim=-1)
        cos, sin = cos_sin[:, 0].unsqueeze(1), cos_sin[:, 1].unsqueeze(1)  # (T, 1, rotary_dim)
        rotated = torch.roll(x, rotary_dim // 2, dims=-1)  # cat(x2, x1)
        return torch.addcmul(x * cos, rotated, sin)
