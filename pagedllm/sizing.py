"""KV-cache, weight and activation arithmetic (bytes, tokens), shared by the engine's sizing and ``pagedllm plan``.

No torch, so the two never disagree. K/V bytes per block = 2 × layers_per_block × block_size ×
KV heads × head_dim × element bytes (Kwon et al., SOSP 2023, §2-3); blocks = KV budget // that;
on a GPU the budget is utilization × memory − weights − peak activations (vLLM's rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from pagedllm.core.kv_cache_groups import (KVCacheGroupSpec, cdiv, layers_per_block, make_kv_cache_groups,
                                           max_num_blocks_per_seq)

GiB = 1024**3

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}

# Bits per linear weight, scales included: int4 = 4 + a float32 scale and zero (or min) per group of 128, its
# default group (64: 5, 32: 6); GGML types from their block structs (q8_0: 34 bytes per 32 weights, ...).
# Embeddings and norms keep the model dtype.
QUANTIZATION_BITS: dict[str, float] = {
    "int8": 8.0, "w8a8": 8.0, "fp8": 8.0, "int4": 4.5,
    "q8_0": 8.5, "q6_k": 6.5625, "q5_k": 5.5, "q5_0": 5.5, "q5_1": 6.0, "q4_k": 4.5, "q4_1": 5.0, "q4_0": 4.5,
}


# Scale bytes per token and KV head (fp8's per-tensor scales are per layer: 0).
KV_SCALE_BYTES: dict[str, int] = {"int8": 4}


def kv_dtype_bytes(name: str) -> tuple[int, int]:
    """(element bytes, scale bytes per token and KV head) of a KV cache. Raises ValueError naming ``kv_cache_dtype``."""
    if name == "int8":
        return 1, KV_SCALE_BYTES["int8"]
    if name not in DTYPE_BYTES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join([*DTYPE_BYTES, 'int8'])}, got {name!r}")
    return DTYPE_BYTES[name], KV_SCALE_BYTES.get(name, 0)


def dtype_bytes(name: str, field_name: str = "dtype") -> int:
    """Element size in bytes of a dtype name. Raises ValueError naming ``field_name``."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"{field_name} must be one of {', '.join(DTYPE_BYTES)}, got {name!r}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class ModelShape:
    """The config numbers memory depends on; ``num_params`` None: count from the shape.

    ``layer_windows``: per layer, the sliding window in tokens or None (full); None: all full.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    layer_windows: tuple[int | None, ...] | None = None
    num_params: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"model {self.name}: {name} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_kv_heads ({self.num_kv_heads})")
        if self.layer_windows is not None and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"model {self.name}: layer_windows has {len(self.layer_windows)} entries for "
                             f"{self.num_layers} layers")

    @classmethod
    def from_hf_config(cls, config: Any, name: str = "model", num_params: int | None = None) -> "ModelShape":
        """From a transformers config, object or dict (its ``text_config`` if any). Raises ValueError if incomplete."""
        config = getattr(config, "text_config", None) or config
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else \
            (lambda k, d=None: getattr(config, k, d))
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                               "vocab_size") if get(k) is None]
        if missing:
            raise ValueError(f"model {name}: the config lacks {', '.join(missing)}")
        head_dim = get("head_dim") or hidden // heads
        return cls(name=name, num_layers=get("num_hidden_layers"), hidden_size=hidden, num_attention_heads=heads,
                   num_kv_heads=get("num_key_value_heads") or heads, head_dim=head_dim,
                   intermediate_size=get("intermediate_size"), vocab_size=get("vocab_size"),
                   max_position_embeddings=get("max_position_embeddings") or 2048,
                   tie_word_embeddings=bool(get("tie_word_embeddings", False)),
                   attention_bias=bool(get("attention_bias", False)) or get("model_type") == "qwen2",
                   layer_windows=_layer_windows(get, get("num_hidden_layers")), num_params=num_params)

    def linear_param_count(self) -> int:
        """Parameters of the attention and MLP projections, all layers."""
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_kv_heads * hd
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size
        return self.num_layers * per_layer

    def linear_shapes(self) -> list[tuple[int, int, bool]]:
        """(out, in, has_bias) of one layer's linears as built (q/k/v, gate/up merged), then the lm_head's."""
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_kv_heads * hd
        layer = [(q + 2 * kv, h, self.attention_bias), (h, q, False), (2 * self.intermediate_size, h, False),
                 (h, self.intermediate_size, False)]
        return layer + [(self.vocab_size, h, False)]

    def param_count(self) -> int:
        """``num_params``, else counted from the shape."""
        if self.num_params is not None:
            return self.num_params
        h = self.hidden_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        bias = self.num_layers * (self.num_attention_heads + 2 * self.num_kv_heads) * self.head_dim \
            if self.attention_bias else 0
        norms = (2 * self.num_layers + 1) * h
        return embed + self.linear_param_count() + bias + norms


def _layer_windows(get, num_layers: int) -> tuple[int | None, ...] | None:
    window = get("sliding_window")
    if not window or get("use_sliding_window") is False:
        return None
    types = get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * num_layers


# The K/V functions take anything with num_layers, num_kv_heads and head_dim (the engine passes its model).
def kv_heads_per_rank(shape: Any, tensor_parallel_size: int = 1) -> int:
    """KV heads per tensor-parallel rank (replicated when fewer than ranks)."""
    return max(1, shape.num_kv_heads // tensor_parallel_size)


def kv_cache_groups_for(shape: ModelShape, hybrid: bool = True) -> list[KVCacheGroupSpec]:
    windows = shape.layer_windows or (None,) * shape.num_layers
    return make_kv_cache_groups(list(windows), hybrid=hybrid)


def kv_bytes_per_token(shape: Any, kv_dtype_bytes: int, tensor_parallel_size: int = 1, scale_bytes: int = 0) -> int:
    """2 × layers × KV heads × (head_dim × bytes + ``scale_bytes``), on one rank."""
    return kv_bytes_per_block(shape, 1, kv_dtype_bytes, None, tensor_parallel_size, scale_bytes)


def kv_bytes_per_block(shape: Any, block_size: int, kv_dtype_bytes: int, num_layers_per_block: int | None = None,
                       tensor_parallel_size: int = 1, scale_bytes: int = 0) -> int:
    """One block on one rank: ``block_size`` tokens of ``num_layers_per_block`` layers (default all)."""
    layers = shape.num_layers if num_layers_per_block is None else num_layers_per_block
    per_token_head = shape.head_dim * kv_dtype_bytes + scale_bytes
    return 2 * layers * block_size * kv_heads_per_rank(shape, tensor_parallel_size) * per_token_head


def kv_tokens_per_layer(shape: ModelShape, num_tokens: int) -> list[int]:
    """Tokens each layer keeps of a ``num_tokens`` sequence (a sliding layer: its window)."""
    windows = shape.layer_windows or (None,) * shape.num_layers
    return [num_tokens if w is None else min(num_tokens, w) for w in windows]


def contiguous_bytes_per_sequence(shape: ModelShape, max_model_len: int, kv_dtype_bytes: int,
                                  tensor_parallel_size: int = 1, scale_bytes: int = 0) -> int:
    """What a contiguous allocator (Orca, a static batch) reserves per sequence: ``max_model_len`` slots a layer."""
    per_layer_token = kv_bytes_per_block(shape, 1, kv_dtype_bytes, 1, tensor_parallel_size, scale_bytes)
    return sum(kv_tokens_per_layer(shape, max_model_len)) * per_layer_token


def blocks_per_sequence(num_tokens: int, block_size: int) -> int:
    return cdiv(num_tokens, block_size)


def num_blocks_for_budget(kv_budget_bytes: int, bytes_per_block: int) -> int:
    return max(kv_budget_bytes, 0) // bytes_per_block


def contiguous_max_sequences(kv_budget_bytes: int, bytes_per_sequence: int) -> int:
    return max(kv_budget_bytes, 0) // bytes_per_sequence


def lora_slot_bytes(shape: ModelShape, max_loras: int, max_lora_rank: int, dtype_bytes: int, tp: int = 1) -> int:
    """Device bytes of ``max_loras`` LoRA slots of rank ``max_lora_rank`` on every projection (pagedllm.lora's
    layout: per projection A^T (in, slices x R) and per slice B^T (R, out); per rank under tensor parallelism)."""
    h, r = shape.hidden_size, max_lora_rank
    q, kv, inter = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.intermediate_size
    per_layer = (h * 3 * r + r * (q + 2 * kv) // tp  # q/k/v: column-parallel, B split
                 + q // tp * r + r * h  # o: row-parallel, A split
                 + h * 2 * r + r * 2 * inter // tp  # gate/up
                 + inter // tp * r + r * h)  # down
    return per_layer * shape.num_layers * max_loras * dtype_bytes


def weight_bytes(shape: ModelShape, dtype_bytes_: int, quantization: str | None = None,
                 tensor_parallel_size: int = 1) -> int:
    """Weight bytes on one rank, linears at :data:`QUANTIZATION_BITS`, split evenly over ranks.

    Raises ValueError for an unknown ``quantization``.
    """
    total = shape.param_count()
    if quantization in (None, "none"):
        num = total * dtype_bytes_
    elif quantization in QUANTIZATION_BITS:
        linear = shape.linear_param_count()
        num = (total - linear) * dtype_bytes_ + math.ceil(linear * QUANTIZATION_BITS[quantization] / 8)
    else:
        raise ValueError(f"quantization must be none or one of {', '.join(QUANTIZATION_BITS)}, got {quantization!r}")
    return cdiv(num, tensor_parallel_size)


def activation_bytes(shape: ModelShape, num_tokens: int, num_logit_rows: int, dtype_bytes_: int,
                     tensor_parallel_size: int = 1) -> int:
    """Estimated peak activation bytes of a forward pass (CUDA measures it instead).

    Per token, the larger of the MLP (2·hidden + 3·intermediate) and attention
    (2·hidden + (2·heads + 2·kv_heads)·head_dim) peaks, plus float32 logits of ``num_logit_rows``.
    """
    tp = tensor_parallel_size
    h, hd = shape.hidden_size, shape.head_dim
    mlp = 2 * h + 3 * shape.intermediate_size // tp
    attn = 2 * h + (2 * shape.num_attention_heads // tp + 2 * kv_heads_per_rank(shape, tp)) * hd
    logits = num_logit_rows * cdiv(shape.vocab_size, tp) * 4
    return num_tokens * max(mlp, attn) * dtype_bytes_ + logits


def gpu_kv_budget_bytes(device_memory_bytes: int, gpu_memory_utilization: float, weight_bytes_: int,
                        activation_bytes_: int) -> int:
    return int(device_memory_bytes * gpu_memory_utilization) - weight_bytes_ - activation_bytes_


@dataclass(frozen=True)
class KVCacheSpec:
    """The paged KV cache as sized at start-up; ``max_chunk_tokens`` bounds a sliding group's blocks."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = ()
    max_chunk_tokens: int = 2048
    kv_cache_dtype: str | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V of every layer fit in the pool."""
        return self.num_blocks * self.block_size * self.layers_per_block // self.num_layers

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_ids) for g in self.kv_cache_groups) or self.layers_per_block

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def is_hybrid(self) -> bool:
        return any(g.sliding_window for g in self.kv_cache_groups)

    @property
    def num_usable_blocks(self) -> int:
        """A hybrid pool reserves block 0 as the null block."""
        return self.num_blocks - self.is_hybrid

    def blocks_per_seq_at(self, num_tokens: int) -> int:
        groups = self.kv_cache_groups or (KVCacheGroupSpec((0,)),)
        return max_num_blocks_per_seq(groups, num_tokens, self.block_size, self.max_chunk_tokens)

    @property
    def blocks_per_seq(self) -> int:
        return self.blocks_per_seq_at(self.max_model_len)

    @property
    def num_blocks_needed(self) -> int:
        return self.blocks_per_seq + self.is_hybrid

    @property
    def bytes_per_seq(self) -> int:
        return self.blocks_per_seq * self.bytes_per_block

    @property
    def layers_per_block(self) -> int:
        return layers_per_block(self.kv_cache_groups) if self.kv_cache_groups else 1

    def max_concurrency_at(self, num_tokens: int) -> float:
        return self.num_usable_blocks / self.blocks_per_seq_at(num_tokens)

    @property
    def max_concurrency(self) -> float:
        return self.max_concurrency_at(self.max_model_len)

    @property
    def full_attention_max_concurrency(self) -> float:
        blocks_per_seq = cdiv(self.max_model_len, self.block_size) * self.num_layers / self.layers_per_block
        return self.num_blocks / blocks_per_seq

    def describe(self) -> str:
        dtype = f" ({self.kv_cache_dtype})" if self.kv_cache_dtype else ""
        head = f"KV cache{dtype}: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens"
        concurrency = f"max concurrency {self.max_concurrency:.2f} sequences at max_model_len {self.max_model_len}"
        if not self.is_hybrid:
            return f"{head}, {self.num_bytes / GiB:.2f} GiB; {concurrency}"
        windows = sorted({g.sliding_window for g in self.kv_cache_groups if g.sliding_window})
        num_sliding = sum(1 for g in self.kv_cache_groups if g.sliding_window)
        return (f"{head} per KV-cache group, {self.num_bytes / GiB:.2f} GiB (hybrid: {len(self.kv_cache_groups)} "
                f"KV-cache groups of {self.layers_per_block} layers, {num_sliding} sliding-window, share the blocks; "
                f"a sequence takes a slot per token in each group, a sliding-window group only for its last "
                f"{'/'.join(map(str, windows))} tokens); {concurrency} "
                f"({self.full_attention_max_concurrency:.2f} if every group kept every token)")

    def too_small_message(self, source: str) -> str | None:
        """The error text when one ``max_model_len`` sequence does not fit, naming setting ``source``; else None."""
        needed, per_block = self.num_blocks_needed, self.bytes_per_block
        if self.num_blocks >= needed:
            return None
        return (f"{source} too small: the KV cache holds {self.num_blocks} blocks ({self.num_tokens} tokens, "
                f"{self.num_bytes / 2**20:.1f} MiB) but one sequence of max_model_len={self.max_model_len} "
                f"tokens needs {needed} blocks ({needed * per_block / 2**20:.1f} MiB); raise {source} or lower "
                f"max_model_len")


def format_bytes(num: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num) >= size:
            return f"{num / size:.2f} {unit}"
    return f"{int(num)} B"


def sum_params(shapes: Sequence[Sequence[int]]) -> int:
    return sum(math.prod(s) for s in shapes)
