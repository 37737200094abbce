"""Which layers use a sliding window, from a transformers config, without torch: ``layer_types``, or
(Mistral, Phi-3) ``sliding_window`` alone on every layer."""

from __future__ import annotations

from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"


def layer_types(config: Any) -> list[str]:
    """``"sliding_attention"`` or ``"full_attention"`` per layer. Raises ValueError for a
    ``layer_types`` of the wrong length or with another attention type."""
    num_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return [SLIDING if window else FULL] * num_layers
    types = list(types)
    if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"layer_types must list {num_layers} entries of {SLIDING!r} or {FULL!r}, got {types}")
    if SLIDING in types and not window:
        raise ValueError("layer_types has sliding_attention layers but the config has no sliding_window")
    return types


def sliding_windows(config: Any) -> list[int | None]:
    """Per layer: its sliding window W in tokens, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    return [int(window) if t == SLIDING else None for t in layer_types(config)]
