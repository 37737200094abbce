"""The model's sampling defaults (``generation_config.json``) for request fields left out, as vLLM:
``--generation-config auto`` reads the model folder's file, a folder path that folder's, ``vllm`` none."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("pagedllm.server")

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


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
        if not path.is_dir() or not (path / "generation_config.json").is_file():
            return {}
    else:
        path = Path(mode)
        if not (path / "generation_config.json").is_file():
            raise ValueError(f"generation_config must be auto, vllm or a folder with generation_config.json, "
                             f"got {mode!r}")
    with open(path / "generation_config.json", encoding="utf-8") as f:
        config = json.load(f)
    defaults = {k: config[k] for k in SAMPLING_FIELDS if isinstance(config.get(k), (int, float))}
    if defaults:
        logger.info("sampling defaults from %s: %s (a request's own fields win; --generation-config vllm turns "
                    "them off)", path / "generation_config.json", defaults)
    return defaults


def apply_generation_defaults(request: Any, defaults: dict[str, Any]) -> None:
    """Set each default on ``request`` (a pydantic request) where the field is absent (None)."""
    for name, value in defaults.items():
        if name in type(request).model_fields and getattr(request, name) is None:
            setattr(request, name, value)
