"""KV-cache groups: which layers share a block table (vLLM v1's hybrid KV cache; no torch).
Each attention type (full, or window W) is cut into groups of ``layers_per_block`` layers (the
smallest type's count, or the largest when they differ by under 25%); layer j of every group uses
KV tensor j, so a block id means the same bytes in every group and one pool serves them all.
A token at ``p`` with window W sees keys ``p - W + 1 .. p``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pagedllm.utils import cdiv


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """The layers sharing a block table (``layer_ids[j]`` uses KV tensor j) and their window in
    tokens, or None for full attention."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")

    def max_num_blocks(self, num_tokens: int, block_size: int, max_chunk_tokens: int) -> int:
        """Most blocks a ``num_tokens`` sequence holds here at once, ``max_chunk_tokens`` per step:
        sliding, ``cdiv(W - 1 + chunk, block_size) + 1`` (vLLM's ``SlidingWindowSpec``)."""
        num_full = cdiv(num_tokens, block_size)
        if self.sliding_window is None:
            return num_full
        return min(num_full, cdiv(self.sliding_window - 1 + max_chunk_tokens, block_size) + 1)


def make_kv_cache_groups(layer_sliding_windows: Sequence[int | None], hybrid: bool = True) -> list[KVCacheGroupSpec]:
    """Groups from each layer's window (None: full attention): full first, then windows ascending.
    ``hybrid=False`` (vLLM's ``--disable-hybrid-kv-cache-manager``): one full group keeping every
    block. ValueError for no layers or a window that is not a positive integer."""
    if not layer_sliding_windows:
        raise ValueError("layer_sliding_windows must name at least one layer")
    by_type: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_sliding_windows):
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"sliding window of layer {i} must be a positive integer or None, got {w!r}")
        by_type.setdefault(w, []).append(i)
    if len(by_type) == 1:
        (window, layers), = by_type.items()
        return [KVCacheGroupSpec(tuple(layers), window if hybrid else None)]
    if not hybrid:
        return [KVCacheGroupSpec(tuple(range(len(layer_sliding_windows))), None)]
    counts = [len(v) for v in by_type.values()]
    size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    groups = []
    for window in sorted(by_type, key=lambda w: -1 if w is None else w):
        layers = by_type[window]
        groups += [KVCacheGroupSpec(tuple(layers[i:i + size]), window) for i in range(0, len(layers), size)]
    return groups


def layers_per_block(groups: Sequence[KVCacheGroupSpec]) -> int:
    return max(len(g.layer_ids) for g in groups)


def max_num_blocks_per_seq(groups: Sequence[KVCacheGroupSpec], num_tokens: int, block_size: int,
                           max_chunk_tokens: int) -> int:
    return sum(g.max_num_blocks(num_tokens, block_size, max_chunk_tokens) for g in groups)
