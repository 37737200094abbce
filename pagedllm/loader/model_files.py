"""One entry point for every model format: :func:`load_model_files` → :class:`ModelFiles`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Mapping

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerFast

from pagedllm.loader import gguf as gguf_loader
from pagedllm.loader import hf as hf_loader
from pagedllm.loader.quantization_config import CheckpointQuantization, parse_quantization_config
from pagedllm.loader.resolve import ResolvedModel, resolve_model
from pagedllm.loader.tokenizer import (chat_template_of, gguf_end_of_generation_ids, load_gguf_tokenizer,
                                       load_hf_tokenizer)

WeightsFn = Callable[..., Iterator[tuple[str, torch.Tensor]]]

# As vLLM's _get_and_verify_max_len reads them.
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "max_sequence_length", "max_seq_length", "seq_len")


@dataclass
class ModelFiles:
    """A model's config, tokenizer and end ids, weights read lazily; stops are sorted, without eos."""

    hf_config: PretrainedConfig = field(repr=False)
    tokenizer: PreTrainedTokenizerFast = field(repr=False)
    chat_template: str | None = field(repr=False)
    eos_token_id: int | None
    stop_token_ids: list[int]
    max_model_len: int
    source: str
    format: Literal["gguf", "hf"]
    _weights_fn: WeightsFn = field(repr=False)
    gguf_tensor_types: dict | None = field(default=None, repr=False)
    checkpoint_quantization: CheckpointQuantization | None = None

    def weights(self, dtype: torch.dtype = torch.float32, packed: Mapping[str, int] | frozenset[str] = frozenset()
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` one at a time, dense, in ``dtype``, on CPU.

        GGUF tensors named in ``packed`` come as raw block bytes, uint8 (rows, bytes per row; a mapping:
        zero-padded on the right to the width it gives); those of a pre-quantized Hugging Face folder
        (``checkpoint_quantization``) as stored (scales not cast).
        Raises ValueError for a non-float ``dtype`` or ``packed`` on a float Hugging Face folder.
        """
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        if packed and self.format != "gguf" and self.checkpoint_quantization is None:
            raise ValueError("packed weights exist only in GGUF files and pre-quantized checkpoints")
        return self._weights_fn(dtype, packed) if packed else self._weights_fn(dtype)


def load_model_files(model: str, tokenizer: str | None = None) -> ModelFiles:
    """Resolve ``model`` (and ``tokenizer``, default the model's own) and load config and tokenizer.

    Raises :class:`ModelNotFoundError` saying what to install; ValueError for a bad or unsupported file.
    """
    resolved = resolve_model(model)
    tokenizer_source = resolve_model(tokenizer) if tokenizer is not None else resolved
    if resolved.format == "gguf":
        return _load_gguf(resolved, tokenizer_source)
    return _load_hf(resolved, tokenizer_source)


def _load_tokenizer(resolved: ResolvedModel) -> PreTrainedTokenizerFast:
    if resolved.format == "gguf":
        return load_gguf_tokenizer(resolved.path)
    return load_hf_tokenizer(resolved.path)


def _load_gguf(resolved: ResolvedModel, tokenizer_source: ResolvedModel) -> ModelFiles:
    gguf_file = gguf_loader.GGUFFile(resolved.path)
    metadata = gguf_file.metadata
    config = gguf_loader.gguf_config(metadata, {t.name for t in gguf_file.tensors},
                                     gguf_loader.read_rope_freqs(gguf_file))
    tokenizer = _load_tokenizer(tokenizer_source)  # after the file and config are known to be good
    eos, stops = gguf_end_of_generation_ids(
        metadata, metadata.get("tokenizer.ggml.tokens", []), metadata.get("tokenizer.ggml.token_type", []))
    return ModelFiles(
        hf_config=config, tokenizer=tokenizer,
        chat_template=_with_chat_template(tokenizer, metadata.get("tokenizer.chat_template")),
        eos_token_id=eos, stop_token_ids=stops, max_model_len=max_model_len_of(config),
        source=str(resolved.path), format="gguf",
        _weights_fn=lambda dtype, packed=frozenset(): gguf_loader.iter_gguf_weights(gguf_file, config, dtype, packed),
        gguf_tensor_types=gguf_loader.gguf_tensor_types(gguf_file))


def _load_hf(resolved: ResolvedModel, tokenizer_source: ResolvedModel) -> ModelFiles:
    folder = resolved.path
    config = hf_loader.load_hf_config(folder)
    quantization = parse_quantization_config(getattr(config, "quantization_config", None))
    hf_loader.safetensors_files(folder)  # fail now, not at weight-loading time, if weights are missing
    tokenizer = _load_tokenizer(tokenizer_source)
    eos = tokenizer.eos_token_id
    if eos is None:
        config_eos = getattr(config, "eos_token_id", None)
        eos = config_eos[0] if isinstance(config_eos, list) and config_eos else config_eos
    stops = sorted(set(hf_loader.load_generation_eos_ids(folder)) - {eos})
    return ModelFiles(
        hf_config=config, tokenizer=tokenizer,
        chat_template=_with_chat_template(tokenizer, hf_loader.read_chat_template(folder)),
        eos_token_id=eos, stop_token_ids=stops, max_model_len=max_model_len_of(config),
        source=str(folder), format="hf",
        _weights_fn=lambda dtype, packed=frozenset(): hf_loader.iter_safetensors_weights(folder, config, dtype,
                                                                                        packed),
        checkpoint_quantization=quantization)


def _with_chat_template(tokenizer: PreTrainedTokenizerFast, model_template: str | None) -> str | None:
    """The tokenizer's chat template, else the model's own (set on the tokenizer for ``apply_chat_template``)."""
    template = chat_template_of(tokenizer)
    if template is None and model_template:
        tokenizer.chat_template = template = model_template
    return template


def max_model_len_of(config: PretrainedConfig) -> int:
    """Context length in tokens, as vLLM's ``_get_and_verify_max_len``. Raises ValueError if none is named."""
    config = getattr(config, "text_config", None) or config
    lengths = [getattr(config, k) for k in _MAX_LEN_KEYS if isinstance(getattr(config, k, None), int)]
    if not lengths:
        raise ValueError(f"the model config has none of {_MAX_LEN_KEYS}; pass max_model_len explicitly")
    length = min(lengths)
    rope = _rope_params(config)
    factor = rope.get("factor")
    if rope.get("rope_type") in ("linear", "yarn") and factor:
        if rope.get("rope_type") == "yarn":
            length = rope.get("original_max_position_embeddings", length)
        length = int(length * factor)
    return length


def _rope_params(config: PretrainedConfig) -> dict:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "rope_type" not in rope and "type" not in rope:
        rope = rope.get("full_attention", {}) if isinstance(rope.get("full_attention"), dict) else {}
    return {**rope, "rope_type": rope.get("rope_type", rope.get("type"))}
