"""Model loading: ``load_model_files(alias | .gguf | HF folder)`` → :class:`ModelFiles`.

Names are imported lazily, so ``from pagedllm.loader import resolve_model`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "ModelFiles": "model_files", "load_model_files": "model_files", "max_model_len_of": "model_files",
    "KNOWN_MODELS": "resolve", "ModelNotFoundError": "resolve", "ResolvedModel": "resolve",
    "resolve_model": "resolve",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from pagedllm.loader.model_files import ModelFiles, load_model_files, max_model_len_of
    from pagedllm.loader.resolve import KNOWN_MODELS, ModelNotFoundError, ResolvedModel, resolve_model


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedllm.loader' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pagedllm.loader.{_EXPORTS[name]}"), name)
