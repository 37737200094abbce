"""GGUF files (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): config and HF-named dense weights.

:class:`GGUFFile` memory-maps the file and skips the string arrays it is not asked for (unlike
``gguf.GGUFReader``); ``gguf.quants`` dequantizes. Undone from llama.cpp's ``convert_hf_to_gguf.py``:
tensor names, the llama Q/K row permutation, and the ``+ 1`` on Gemma norm weights.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quant_shape_to_byte_shape
from transformers import AutoConfig, PretrainedConfig


# Only the families whose tensors _BLOCK_TENSORS covers.
_MODEL_TYPES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
    "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text",
}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
}
# convert_hf_to_gguf.py permutes Q/K rows (LlamaModel) and stores Gemma norms as w + 1.
_PERMUTED_QK_ARCHS = frozenset({"llama", "mistral"})
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
    # experts stacked (experts, out, in); "*" is the expert index
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.*.gate_proj", "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj",
}
_GEMMA_BLOCK_OVERRIDES = {"ffn_norm": "pre_feedforward_layernorm"}
# Recomputed from the config.
_SKIPPED_TENSORS = frozenset({"rope_freqs"})

# "{arch}.<key>" → config field: transformers' GGUF_CONFIG_MAPPING, the fields the models read.
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
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}
# llama.cpp writes Mixtral as architecture "llama" with these keys.
_MIXTRAL_KEYS = {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"}
# The GGUF has no query_pre_attn_scalar; llama.cpp tells the 27B Gemmas by layer count (LLM_TYPE_27B).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


_GGUF_MAGIC = b"GGUF"
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
DEFAULT_STRING_ARRAYS = ("tokenizer.ggml.tokens",)


@dataclass(frozen=True)
class GGUFTensorInfo:
    """``shape``: elements, slowest first (GGUF lists them reversed); ``offset``: absolute, in bytes."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    offset: int
    nbytes: int


class GGUFFile:
    """A memory-mapped GGUF v2/v3 file; string arrays not in ``string_arrays`` are given as their length.

    Raises ValueError naming the file if it is not GGUF v2/v3 or is truncated."""

    def __init__(self, path: str | Path, string_arrays: tuple[str, ...] = DEFAULT_STRING_ARRAYS):
        self.path = str(path)
        try:
            self._blob = np.memmap(self.path, dtype=np.uint8, mode="r")
            self._parse(set(string_arrays))
        except (struct.error, ValueError, OSError, IndexError) as e:
            raise ValueError(f"{self.path!r} is not a readable GGUF file: {e}") from e

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """Read-only view of a tensor's data: F32/F16 typed of ``shape``; else uint8, last axis in bytes."""
        data = self._blob[info.offset:info.offset + info.nbytes]
        if info.tensor_type in _DTYPES:
            return data.view(_DTYPES[info.tensor_type]).reshape(info.shape)
        return data.reshape(quant_shape_to_byte_shape(info.shape, info.tensor_type))

    def _parse(self, string_arrays: set[str]) -> None:
        if bytes(self._blob[:4]) != _GGUF_MAGIC:
            raise ValueError("missing the GGUF magic bytes")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", self._blob, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        pos, self.metadata = 24, {}
        for _ in range(num_kv):
            key, pos = self._string(pos)
            (kind,) = struct.unpack_from("<I", self._blob, pos)
            self.metadata[key], pos = self._value(pos + 4, GGUFValueType(kind), key in string_arrays)
        entries = []
        for _ in range(num_tensors):
            name, pos = self._string(pos)
            (num_dims,) = struct.unpack_from("<I", self._blob, pos)
            dims = struct.unpack_from(f"<{num_dims}Q", self._blob, pos + 4)
            kind, offset = struct.unpack_from("<IQ", self._blob, pos + 4 + 8 * num_dims)
            pos += 4 + 8 * num_dims + 12
            entries.append((name, tuple(reversed(dims)), GGMLQuantizationType(kind), offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-pos // alignment) * alignment
        self.tensors = [GGUFTensorInfo(name, shape, kind, data_start + offset, _num_bytes(shape, kind))
                        for name, shape, kind, offset in entries]
        last = max((t.offset + t.nbytes for t in self.tensors), default=data_start)
        if last > len(self._blob):
            raise ValueError(f"file is truncated: tensor data ends at byte {last}, file has {len(self._blob)}")

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._blob, pos)
        return bytes(self._blob[pos + 8:pos + 8 + length]).decode("utf-8"), pos + 8 + length

    def _value(self, pos: int, kind: GGUFValueType, decode_strings: bool):
        if kind in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[kind]
            return struct.unpack_from(fmt, self._blob, pos)[0], pos + struct.calcsize(fmt)
        if kind == GGUFValueType.STRING:
            return self._string(pos)
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item_kind, count = struct.unpack_from("<IQ", self._blob, pos)
        item_kind, pos = GGUFValueType(item_kind), pos + 12
        if item_kind in _SCALAR_FORMATS:
            dtype = np.dtype(_SCALAR_FORMATS[item_kind])
            values = np.frombuffer(self._blob, dtype=dtype, count=count, offset=pos).tolist()
            return values, pos + count * dtype.itemsize
        if item_kind != GGUFValueType.STRING:
            raise ValueError("nested GGUF arrays are not supported")
        if decode_strings:
            values = []
            for _ in range(count):
                value, pos = self._string(pos)
                values.append(value)
            return values, pos
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", self._blob, pos)[0]
        return count, pos


def _num_bytes(shape: tuple[int, ...], kind: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[kind]
    return int(np.prod(shape, dtype=np.int64)) // block_size * type_size


def read_rope_freqs(gguf_file: GGUFFile) -> np.ndarray | None:
    """The ``rope_freqs.weight`` tensor (llama3 rope scaling divisors), or None if absent."""
    for info in gguf_file.tensors:
        if info.name == "rope_freqs.weight":
            return dequantize_tensor(gguf_file.raw(info), info.tensor_type, info.name)
    return None


def read_gguf_metadata(path: str | Path) -> tuple[dict, set[str]]:
    """``(metadata, tensor_names)`` of a GGUF file, from its header only."""
    gguf_file = GGUFFile(path)
    return gguf_file.metadata, {t.name for t in gguf_file.tensors}


def gguf_config(metadata: dict, tensor_names: set[str], rope_freqs: np.ndarray | None = None) -> PretrainedConfig:
    """The transformers config of GGUF metadata; no ``output.weight`` means tied embeddings.

    ``rope_freqs``: the file's ``(head_dim // 2,)`` float32 tensor, if any. Raises ValueError for an
    unsupported architecture, a ``rope_freqs`` that is not llama3 scaling, or a split GGUF.
    """
    arch = metadata.get("general.architecture")
    if arch not in _MODEL_TYPES:
        raise ValueError(f"GGUF general.architecture {arch!r} is not supported; supported: "
                         f"{sorted(_MODEL_TYPES)}")
    if int(metadata.get("split.count", 1)) > 1:
        raise ValueError(f"this GGUF is shard 1 of {metadata['split.count']} (split.count); merge the shards "
                         f"into one file with `llama-gguf-split --merge first-shard.gguf merged.gguf`")
    model_type = _MODEL_TYPES[arch]
    fields = {hf: metadata[f"{arch}.{key}"] for key, hf in _CONFIG_KEYS.items() if f"{arch}.{key}" in metadata}
    if arch == "llama" and metadata.get("llama.expert_count", 0) > 0:
        model_type = "mixtral"
        fields.update({hf: metadata[f"llama.{key}"] for key, hf in _MIXTRAL_KEYS.items()})
    if "vocab_size" not in fields:
        fields["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    if "head_dim" not in fields and f"{arch}.rope.dimension_count" in metadata and arch in _PERMUTED_QK_ARCHS:
        fields["head_dim"] = metadata[f"{arch}.rope.dimension_count"]
    for token in ("bos", "eos", "pad"):
        if f"tokenizer.ggml.{token}_token_id" in metadata:
            fields[f"{token}_token_id"] = metadata[f"tokenizer.ggml.{token}_token_id"]
    rope_scaling = _rope_scaling(metadata, arch)
    if rope_freqs is not None:
        head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
        rope_scaling = llama3_rope_scaling(rope_freqs, float(fields.get("rope_theta", 10000.0)), head_dim)
    elif "rope_freqs.weight" in tensor_names:
        raise ValueError("the GGUF has a rope_freqs tensor: pass it as rope_freqs to rebuild rope scaling")
    if rope_scaling is not None:
        fields["rope_scaling"] = rope_scaling
    if arch in _GEMMA_27B_LAYERS:
        fields["query_pre_attn_scalar"] = _gemma_query_pre_attn_scalar(fields, arch)
    fields["tie_word_embeddings"] = "output.weight" not in tensor_names
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [_ARCHITECTURES[model_type]]
    return config


def _gemma_query_pre_attn_scalar(fields: dict, arch: str) -> int:
    if fields.get("num_hidden_layers") == _GEMMA_27B_LAYERS[arch]:
        return fields["hidden_size"] // fields["num_attention_heads"]
    return fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]


def _rope_scaling(metadata: dict, arch: str) -> dict | None:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))}
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


# Llama 3.1-3.3's values, which llama.cpp's converter hard-codes too.
_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original_max_position_embeddings: int) -> np.ndarray:
    """Divisors of llama3 rope scaling, ``(head_dim // 2,)`` float64 (HF's ``_compute_llama3_parameters``)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    middle = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original_max_position_embeddings / high_freq_factor, 1.0,
                    np.where(wavelen > original_max_position_embeddings / low_freq_factor, factor, middle))


def llama3_rope_scaling(rope_freqs: np.ndarray, theta: float, head_dim: int) -> dict:
    """HF's llama3 ``rope_scaling`` from ``rope_freqs``. Raises ValueError unless it matches within 1e-4 relative."""
    rope_freqs = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    scaling = {"rope_type": "llama3", "factor": float(rope_freqs.max()), **_LLAMA3_DEFAULTS}
    expected = llama3_factors(theta, head_dim, **{k: v for k, v in scaling.items() if k != "rope_type"})
    if rope_freqs.shape != expected.shape or not np.allclose(rope_freqs, expected, rtol=1e-4, atol=0):
        raise ValueError("the GGUF's rope_freqs tensor does not match llama3 rope scaling with "
                         f"{_LLAMA3_DEFAULTS}; this rope scaling is not supported")
    return scaling


def hf_tensor_name(gguf_name: str, arch: str) -> str | None:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``; None if recomputed.

    Raises ValueError for an unknown name, so nothing is silently left uninitialised."""
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
    """Inverse of llama.cpp's ``LlamaModel.permute`` (interleaved rotary pairs → HF's two halves).

    ``weight``: (num_heads * head_dim, ...) rows; ``num_heads``: that projection's (KV heads for K).
    """
    rows = weight.shape[0]
    # (num_heads, head_dim // 2, 2, *rest) -> (num_heads, 2, head_dim // 2, *rest)
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize_tensor(data: np.ndarray, tensor_type: GGMLQuantizationType, name: str = "") -> np.ndarray:
    """Writable float32 values of raw data, last axis in elements. Raises ValueError if the type is unsupported."""
    try:
        values = dequantize(data, tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {name!r} has type {tensor_type.name}, which gguf.quants cannot "
                         f"dequantize") from e
    if values.dtype != np.float32 or not values.flags.writeable:
        values = np.array(values, dtype=np.float32)
    return values


def iter_gguf_weights(gguf_file: GGUFFile, config: PretrainedConfig, dtype: torch.dtype,
                      packed: Mapping[str, int] | frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` in file order, one at a time, dequantized to ``dtype``.

    Names in ``packed`` come as stored block bytes, (rows, bytes per row) uint8, rows un-permuted; a mapping
    gives the row width in bytes each is zero-padded to on the right (a fused layer's parts of different types).
    """
    arch = gguf_file.metadata["general.architecture"]
    for info in gguf_file.tensors:
        name = hf_tensor_name(info.name, arch)
        if name is None:
            continue
        if name in packed:
            raw = np.array(_undo_converter(gguf_file.raw(info).reshape(info.shape[0], -1), info.name, arch, config,
                                           is_raw=True))
            width = packed.get(name, raw.shape[1]) if isinstance(packed, Mapping) else raw.shape[1]
            if width > raw.shape[1]:
                raw = np.pad(raw, ((0, 0), (0, width - raw.shape[1])))
            yield name, torch.from_numpy(raw)
            continue
        values = dequantize_tensor(gguf_file.raw(info), info.tensor_type, info.name)
        values = _undo_converter(values, info.name, arch, config)
        if "*" in name:  # one tensor per expert, as HF checkpoints store them
            for e, expert in enumerate(values):
                yield name.replace("*", str(e)), torch.from_numpy(expert).to(dtype)
            continue
        yield name, torch.from_numpy(values).to(dtype)


def gguf_tensor_types(gguf_file: GGUFFile) -> dict[str, GGMLQuantizationType]:
    """HF weight name → GGUF storage type (recomputed tensors left out)."""
    arch = gguf_file.metadata["general.architecture"]
    names = ((hf_tensor_name(info.name, arch), info.tensor_type) for info in gguf_file.tensors)
    return {name: kind for name, kind in names if name is not None}


def _undo_converter(values: np.ndarray, gguf_name: str, arch: str, config: PretrainedConfig,
                    is_raw: bool = False) -> np.ndarray:
    if arch in _PERMUTED_QK_ARCHS:
        if ".attn_q." in gguf_name:
            return unpermute_qk(values, config.num_attention_heads)
        if ".attn_k." in gguf_name:
            return unpermute_qk(values, config.num_key_value_heads)
    if not is_raw and arch in _NORM_PLUS_ONE_ARCHS and gguf_name.endswith("norm.weight"):
        return values - 1.0
    return values
