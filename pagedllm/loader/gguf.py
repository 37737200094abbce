"""GGUF files: hyper-parameters → a transformers config, tensors → HF-named dense weights.

Read with the ``gguf`` package (``GGUFReader`` memory-maps the file; ``gguf.quants.dequantize``
unpacks Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants Q2_K..Q6_K, the IQ types, F16, BF16 and F32).
Three conversions undo what llama.cpp's ``convert_hf_to_gguf.py`` did:

* tensor names: ``blk.{i}.attn_q.weight`` → ``model.layers.{i}.self_attn.q_proj.weight`` etc.;
* the Q/K row permutation of the ``llama`` architecture (``LlamaModel.permute``: llama.cpp
  computes rotary embeddings on interleaved pairs, HF on two halves) — :func:`unpermute_qk`;
* the ``+ 1`` llama.cpp adds to every Gemma norm weight (HF Gemma computes ``x * (1 + w)``).

Tensor layout: GGUF lists dimensions fastest-first (``ne[0]`` = input features); the reader's
numpy arrays are already row-major ``(out_features, in_features)``, the HF ``nn.Linear`` layout.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from transformers import AutoConfig, PretrainedConfig

logger = logging.getLogger(__name__)

# GGUF architecture → transformers model_type. Only dense decoder families whose tensors
# _BLOCK_TENSORS covers are listed; anything else is rejected with a clear error.
_MODEL_TYPES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
    "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text",
}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# llama.cpp permutes Q/K rows only for these (convert_hf_to_gguf.py: LlamaModel and subclasses).
_PERMUTED_QK_ARCHS = frozenset({"llama", "mistral"})
# llama.cpp stores Gemma RMSNorm weights as w + 1 (Gemma*Model.modify_tensors).
_NORM_PLUS_ONE_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma 2/3 have four norms per layer; the one before the MLP is HF's pre_feedforward_layernorm.
_GEMMA_BLOCK_OVERRIDES = {"ffn_norm": "pre_feedforward_layernorm"}
# Tensors recomputed from the config (llama.cpp stores llama3 rope frequency factors as a tensor).
_SKIPPED_TENSORS = frozenset({"rope_freqs"})

# Hyper-parameters: GGUF key (after "{arch}.") → transformers config field. The same table as
# transformers' GGUF_CONFIG_MAPPING, restricted to the fields the engine's models read.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}


def open_gguf(path: str | Path) -> GGUFReader:
    """Memory-map and parse a GGUF file. Raises ValueError naming the file if it is not GGUF."""
    try:
        return GGUFReader(str(path), "r")
    except (ValueError, OSError) as e:
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {e}") from e


def metadata_of(reader: GGUFReader, skip: tuple[str, ...] = ("tokenizer.ggml.merges",)) -> dict:
    """All key/value metadata as Python values (strings, numbers, lists), except ``skip``."""
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


def read_gguf_metadata(path: str | Path) -> tuple[dict, set[str]]:
    """``(metadata, tensor_names)`` of a GGUF file without parsing its tensors' data.

    Uses transformers' header reader (``transformers.integrations.gguf.read_gguf_metadata``),
    which skips the vocabulary-sized string arrays it is not asked for and takes ~0.2 s where
    ``GGUFReader`` takes ~2.5 s on SmolLM2; falls back to ``GGUFReader`` if it is unavailable.
    ``metadata["tokenizer.ggml.tokens"]`` is the full token list; other string arrays (e.g.
    merges) may be given as their length only. Raises ValueError if the file is not GGUF.
    """
    try:
        from transformers.integrations.gguf import read_gguf_metadata as read_header
    except ImportError:
        reader = open_gguf(path)
        return metadata_of(reader), {t.name for t in reader.tensors}
    try:
        metadata, tensor_names = read_header(str(path), ("tokenizer.ggml.tokens",))
    except (ValueError, OSError, struct.error) as e:
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {e}") from e
    return metadata, set(tensor_names)


def gguf_config(metadata: dict, tensor_names: set[str]) -> PretrainedConfig:
    """Build the transformers config (``architectures`` set) from GGUF metadata.

    ``tensor_names`` decides ``tie_word_embeddings`` (no ``output.weight`` → tied). Raises
    ValueError naming ``general.architecture`` if the architecture is not supported.
    """
    arch = metadata.get("general.architecture")
    if arch not in _MODEL_TYPES:
        raise ValueError(f"GGUF general.architecture {arch!r} is not supported; supported: "
                         f"{sorted(_MODEL_TYPES)}")
    model_type = _MODEL_TYPES[arch]
    fields = {hf: metadata[f"{arch}.{key}"] for key, hf in _CONFIG_KEYS.items() if f"{arch}.{key}" in metadata}
    if "vocab_size" not in fields:
        fields["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    if "head_dim" not in fields and f"{arch}.rope.dimension_count" in metadata and arch in _PERMUTED_QK_ARCHS:
        fields["head_dim"] = metadata[f"{arch}.rope.dimension_count"]
    for token in ("bos", "eos", "pad"):
        if f"tokenizer.ggml.{token}_token_id" in metadata:
            fields[f"{token}_token_id"] = metadata[f"tokenizer.ggml.{token}_token_id"]
    rope_scaling = _rope_scaling(metadata, arch, tensor_names)
    if rope_scaling is not None:
        fields["rope_scaling"] = rope_scaling
    fields["tie_word_embeddings"] = "output.weight" not in tensor_names
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [_ARCHITECTURES[model_type]]
    return config


def _rope_scaling(metadata: dict, arch: str, tensor_names: set[str]) -> dict | None:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in tensor_names:
        # llama3-style per-frequency factors: the GGUF keeps only the resulting tensor, not the
        # factors needed to rebuild HF's rope_scaling; short contexts are barely affected.
        logger.warning("GGUF has rope_freqs (llama3 rope scaling); it is ignored — long-context "
                       "outputs will differ from the original model")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))}
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def hf_tensor_name(gguf_name: str, arch: str) -> str | None:
    """The HF parameter name of a GGUF tensor, or None for tensors recomputed from the config.

    ``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``. Raises ValueError for
    a tensor name this loader does not know (so nothing is silently left uninitialised).
    """
    base, _, suffix = gguf_name.rpartition(".")
    if base in _SKIPPED_TENSORS:
        return None
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        table = {**_BLOCK_TENSORS, **_GEMMA_BLOCK_OVERRIDES} if arch in ("gemma2", "gemma3") else _BLOCK_TENSORS
        if parts[2] in table:
            return f"model.layers.{parts[1]}.{table[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} (architecture {arch!r}) has no known HF name")


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py``, ``LlamaModel.permute``).

    llama.cpp reorders each head's rows from HF's "two halves" rotary layout to interleaved
    pairs: ``w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2)``. This is its inverse.
    ``weight``: (num_heads * head_dim, in_features) for weights or (num_heads * head_dim,) for
    biases; ``num_heads`` is the head count of that projection (KV heads for K).
    """
    rows = weight.shape[0]
    # (num_heads, head_dim // 2, 2, *rest) -> (num_heads, 2, head_dim // 2, *rest)
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize_tensor(data: np.ndarray, tensor_type: GGMLQuantizationType, name: str = "") -> np.ndarray:
    """Dense float32 values of a GGUF tensor's raw data (``ReaderTensor.data``).

    Returns a writable float32 array of shape ``data.shape`` with the last axis in elements
    (quantized data arrives as uint8 bytes per row). Raises ValueError naming the tensor and
    type when ``gguf.quants`` cannot dequantize it.
    """
    try:
        values = dequantize(data, tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {name!r} has type {tensor_type.name}, which gguf.quants cannot "
                         f"dequantize") from e
    if values.dtype != np.float32 or not values.flags.writeable:
        values = np.array(values, dtype=np.float32)  # e.g. F32: a read-only view of the mmap
    return values


def iter_gguf_weights(reader: GGUFReader, config: PretrainedConfig, dtype: torch.dtype
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight of the file, dequantized to ``dtype``.

    One tensor is materialized at a time (the file stays memory-mapped). Tensors are yielded in
    file order; with ``tie_word_embeddings`` there is no ``lm_head.weight``.
    """
    arch = _arch_of(reader)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, arch)
        if name is None:
            continue
        values = dequantize_tensor(tensor.data, tensor.tensor_type, tensor.name)
        values = _undo_converter(values, tensor.name, arch, config)
        yield name, torch.from_numpy(values).to(dtype)


def _undo_converter(values: np.ndarray, gguf_name: str, arch: str, config: PretrainedConfig) -> np.ndarray:
    if arch in _PERMUTED_QK_ARCHS:
        if ".attn_q." in gguf_name:
            return unpermute_qk(values, config.num_attention_heads)
        if ".attn_k." in gguf_name:
            return unpermute_qk(values, config.num_key_value_heads)
    if arch in _NORM_PLUS_ONE_ARCHS and gguf_name.endswith("norm.weight"):
        return values - 1.0
    return values


def _arch_of(reader: GGUFReader) -> str:
    return reader.fields["general.architecture"].contents()
