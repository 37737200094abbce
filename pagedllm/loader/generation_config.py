"""A model folder's sampling defaults from its ``generation_config.json`` (vLLM's
``get_diff_sampling_param``): the one reader behind ``pagedllm chat`` and the server's
``--generation-config``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FILE_NAME = "generation_config.json"


def has_generation_config(folder: str | Path) -> bool:
    return (Path(folder) / FILE_NAME).is_file()


def read_sampling_defaults(folder: str | Path) -> dict[str, Any]:
    """The numeric sampling fields of ``folder``'s ``generation_config.json`` ({} when the file is
    absent). ``do_sample: false`` without a temperature means greedy (temperature 0), as
    transformers' ``generate`` reads it. Raises ValueError when the file is not a JSON object."""
    path = Path(folder) / FILE_NAME
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    if config.get("do_sample") is False and config.get("temperature") is None:
        config["temperature"] = 0.0
    return {k: config[k] for k in SAMPLING_FIELDS
            if isinstance(config.get(k), (int, float)) and not isinstance(config.get(k), bool)}
