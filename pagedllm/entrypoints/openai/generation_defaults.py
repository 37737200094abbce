"""The model's sampling defaults (``generation_config.json``) for request fields left out, as vLLM:
``--generation-config auto`` reads the model folder's file, a folder path that folder's, ``vllm`` none."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from pagedllm.loader.generation_config import FILE_NAME, has_generation_config, read_sampling_defaults

logger = logging.getLogger("pagedllm.server")


@functools.lru_cache(maxsize=8)
def generation_defaults(model: str, mode: str) -> dict[str, Any]:
    """The defaults for ``model`` under ``--generation-config mode``. Raises ValueError for a
    ``mode`` that is neither ``auto``, ``vllm`` nor a folder with ``generation_config.json``."""
    if mode == "vllm":
        return {}
    if mode == "auto":
        from pagedllm.loader.resolve import resolve_model

        try:
            path = resolve_model(model).path
        except ValueError:  # not a model on disk (an engine built in memory)
            return {}
        if not path.is_dir() or not has_generation_config(path):
            return {}
    else:
        path = Path(mode)
        if not has_generation_config(path):
            raise ValueError(f"generation_config must be auto, vllm or a folder with generation_config.json, "
                             f"got {mode!r}")
    defaults = read_sampling_defaults(path)
    if defaults:
        logger.info("sampling defaults from %s: %s (a request's own fields win; --generation-config vllm turns "
                    "them off)", path / FILE_NAME, defaults)
    return defaults


def apply_generation_defaults(request: Any, defaults: dict[str, Any]) -> None:
    """Set each default on ``request`` (a pydantic request) where the field is absent (None)."""
    for name, value in defaults.items():
        if name in type(request).model_fields and getattr(request, name) is None:
            setattr(request, name, value)
