"""KV-cache groups: which layers share a block table (the hybrid KV cache).

A model whose layers all attend to the whole context has one group: one block table
per request, every layer's cache indexed by it. A model with sliding-window layers
(Gemma 2/3, Mistral, Qwen2 with ``use_sliding_window``) needs only the last ``W``
tokens' K/V in those layers, so their blocks can go back to the pool as a sequence
grows. Following vLLM v1's hybrid KV-cache manager:

* Layers are grouped by attention type (full, or sliding with window W), and each type
  is cut into groups of the **same number of layers** ``layers_per_block``. Every group
  has its own block table per request.
* All groups draw from **one block pool**. A block is the memory of ``layers_per_block``
  layers × ``block_size`` tokens: the runner allocates ``layers_per_block`` KV tensors
  of ``num_blocks`` blocks each, and layer ``j`` of every group uses tensor ``j``. So a
  block id means the same bytes whichever group holds it, and memory a sliding group
  frees can be taken by a full-attention group (no static split between the types).
  A type whose layer count is not a multiple of ``layers_per_block`` leaves the last
  tensors unused in its last group (vLLM's padding).
* ``layers_per_block`` is the smallest layer count among the types (vLLM's rule), or the
  largest when they differ by less than 25 %, so a model with 3 full and 15 sliding
  layers (Gemma 3 270M) gets 6 groups of 3 layers.

A model with one attention type (all full, or all sliding with one window) has a single
group of all its layers; ``hybrid=False`` (vLLM's ``--disable-hybrid-kv-cache-manager``)
forces one full-attention group that keeps every block.

Window convention (transformers' and vLLM's): a token at position ``p`` in a layer with
window ``W`` attends to keys at positions ``p - W + 1 .. p``.

Pure Python: the scheduler and ``pagedllm plan`` use it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pagedllm.utils import cdiv


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: the layers that share a block table.

    Attributes:
        layer_ids: model layer indices in this group (layer ``layer_ids[j]`` uses KV
            tensor ``j``).
        sliding_window: the window W in tokens of every layer of the group, or None for
            full attention (blocks are kept for the whole sequence).
    """

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")

    def max_num_blocks(self, num_tokens: int, block_size: int, max_chunk_tokens: int) -> int:
        """Most blocks one sequence of ``num_tokens`` tokens holds in this group at once,
        when at most ``max_chunk_tokens`` tokens are computed per step.

        Full attention: ``cdiv(num_tokens, block_size)``. Sliding window W: the blocks of
        the ``W - 1`` tokens before a step's first token plus the step's tokens, one more
        for misalignment, ``cdiv(W - 1 + chunk, block_size) + 1`` (vLLM's
        ``SlidingWindowSpec.max_memory_usage_bytes``), never more than the full count.
        """
        num_full = cdiv(num_tokens, block_size)
        if self.sliding_window is None:
            return num_full
        return min(num_full, cdiv(self.sliding_window - 1 + max_chunk_tokens, block_size) + 1)


def make_kv_cache_groups(layer_sliding_windows: Sequence[int | None], hybrid: bool = True) -> list[KVCacheGroupSpec]:
    """Group a model's layers by attention type into equal-sized KV-cache groups.

    Args:
        layer_sliding_windows: per layer, its sliding window in tokens, or None for full
            attention (one entry per layer, in layer order).
        hybrid: False to keep every block of every layer (one group; a mixed model's
            sliding layers then keep their whole context in memory).

    Returns:
        The groups, full attention first, then sliding windows in increasing size;
        within a type, layers in order. See the module docstring for the sizes.

    Raises:
        ValueError: no layers, or a window that is not a positive integer.
    """
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
    """KV tensors the runner allocates: the largest group's layer count."""
    return max(len(g.layer_ids) for g in groups)


def max_num_blocks_per_seq(groups: Sequence[KVCacheGroupSpec], num_tokens: int, block_size: int,
                           max_chunk_tokens: int) -> int:
    """Most blocks one sequence of ``num_tokens`` tokens holds across all groups at once
    (the sum of :meth:`KVCacheGroupSpec.max_num_blocks`)."""
    return sum(g.max_num_blocks(num_tokens, block_size, max_chunk_tokens) for g in groups)
