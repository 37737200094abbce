"""Hugging Face model folders (config.json + *.safetensors, sharded or not), read from local files only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

SAFETENSORS_INDEX = "model.safetensors.index.json"

# Buffers some old checkpoints saved; the engine recomputes them.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def load_hf_config(folder: str | Path) -> PretrainedConfig:
    """``AutoConfig`` of a folder. Raises ValueError if config.json is unreadable or lacks ``architectures``."""
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read config.json in {str(folder)!r}: {e}") from e
    if not getattr(config, "architectures", None):
        raise ValueError(f"config.json in {str(folder)!r} has no 'architectures' field "
                         f"(e.g. [\"LlamaForCausalLM\"]); add it")
    return config


def load_generation_eos_ids(folder: str | Path) -> list[int]:
    """The ``eos_token_id`` list of ``generation_config.json`` (empty if the file is absent)."""
    if not (Path(folder) / "generation_config.json").is_file():
        return []
    eos = GenerationConfig.from_pretrained(str(folder), local_files_only=True).eos_token_id
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def read_chat_template(folder: str | Path) -> str | None:
    """``chat_template.jinja``, else tokenizer_config.json's ``chat_template`` ("default" of a list), else None."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if not (folder / "tokenizer_config.json").is_file():
        return None
    template = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template or None


def safetensors_files(folder: str | Path) -> list[Path]:
    """The shards the index lists, else every ``*.safetensors``. Raises FileNotFoundError naming what is missing."""
    folder = Path(folder)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{SAFETENSORS_INDEX} in {str(folder)!r} lists missing shards: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {str(folder)!r}; save the model with "
            f"save_pretrained(folder, safe_serialization=True) or convert its .bin files to safetensors")
    return files


def iter_safetensors_weights(folder: str | Path, config: PretrainedConfig, dtype: torch.dtype,
                             kept: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` one at a time, floats cast to ``dtype`` except those named in ``kept``
    (a pre-quantized checkpoint's scales); a tied ``lm_head.weight`` is skipped."""
    is_tied = bool(getattr(config, "tie_word_embeddings", False))
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_SKIPPED_SUFFIXES) or (is_tied and name == "lm_head.weight"):
                    continue
                tensor = f.get_tensor(name)
                yield name, (tensor.to(dtype) if tensor.is_floating_point() and name not in kept else tensor)
