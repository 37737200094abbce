"""The pooling a sentence-transformers folder declares: ``modules.json``, ``1_Pooling/config.json``,
``sentence_bert_config.json`` (``max_seq_length``). No sentence-transformers import is needed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# 1_Pooling/config.json flag -> pagedllm pooling type (vLLM's names)
_POOLING_FLAGS = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS",
                  "pooling_mode_lasttoken": "LAST"}
_UNSUPPORTED_FLAGS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class SentenceTransformersConfig:
    """``pooling_type``: MEAN, CLS or LAST; ``normalize``: a Normalize module follows the pooling;
    ``max_seq_length``: tokens the model was trained on (None: not stated)."""

    pooling_type: str
    normalize: bool
    max_seq_length: int | None


def is_sentence_transformers_folder(folder: str | Path) -> bool:
    return (Path(folder) / "modules.json").is_file()


def read_sentence_transformers_config(folder: str | Path) -> SentenceTransformersConfig:
    """Read the folder's pooling. Raises ValueError naming the file for a pooling mode pagedllm
    does not implement (max, sqrt-length mean, weighted mean) or a malformed file."""
    folder = Path(folder)
    modules = _read_json(folder / "modules.json")
    types = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling_type = "MEAN"  # sentence-transformers' default when no Pooling module is listed
    if "Pooling" in types:
        pool_file = folder / types["Pooling"].get("path", "") / "config.json"
        flags = _read_json(pool_file)
        unsupported = [f for f in _UNSUPPORTED_FLAGS if flags.get(f)]
        chosen = [kind for flag, kind in _POOLING_FLAGS.items() if flags.get(flag)]
        if unsupported or len(chosen) != 1:
            raise ValueError(f"{str(pool_file)!r}: exactly one of {sorted(_POOLING_FLAGS)} must be true "
                             f"(supported pooling: mean, cls, last); got {flags}")
        pooling_type = chosen[0]
    bert_config = folder / "sentence_bert_config.json"
    max_len = _read_json(bert_config).get("max_seq_length") if bert_config.is_file() else None
    return SentenceTransformersConfig(pooling_type, "Normalize" in types, int(max_len) if max_len else None)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read {str(path)!r}: {e}") from e
