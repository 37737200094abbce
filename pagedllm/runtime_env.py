"""Environment variables of torch's CPU libraries that pagedllm must correct before they are read.

Pure Python, no torch: ``pagedllm/__init__.py`` runs this before anything imports torch.
"""

from __future__ import annotations

import re
import warnings
from typing import MutableMapping

LRU_CACHE_CAPACITY_ENV = "LRU_CACHE_CAPACITY"
# ideep's own default capacity of its primitive cache (and oneDNN's, ONEDNN_PRIMITIVE_CACHE_CAPACITY).
DEFAULT_LRU_CACHE_CAPACITY = 1024


def _c_atoi(text: str) -> int:
    """What C's ``atoi`` makes of ``text`` (leading blanks, a sign, digits; anything else is 0)."""
    m = re.match(r"\s*([+-]?\d+)", text)
    return int(m.group(1)) if m else 0


def guard_lru_cache_capacity(environ: MutableMapping[str, str]) -> str | None:
    """Replace an ``LRU_CACHE_CAPACITY`` that ideep (torch's oneDNN wrapper) reads as 0 by
    ``DEFAULT_LRU_CACHE_CAPACITY`` and return the warning to show; None when nothing changed.

    ideep sizes its primitive cache from that variable with ``atoi`` when it first runs a
    oneDNN primitive; a capacity of 0 ("0", "", or text that is not a number) makes the first
    packed linear (every float32 and bfloat16 linear of the CPU model) crash the process with a
    segmentation fault, in torch 2.13 (tests/test_runtime_env.py). Any positive value, and
    negative ones, work. The variable is read lazily, so correcting it after torch is imported
    still holds as long as no oneDNN primitive ran yet — and one that ran would have crashed.
    """
    value = environ.get(LRU_CACHE_CAPACITY_ENV)
    if value is None or _c_atoi(value) != 0:
        return None
    environ[LRU_CACHE_CAPACITY_ENV] = str(DEFAULT_LRU_CACHE_CAPACITY)
    return (f"{LRU_CACHE_CAPACITY_ENV}={value!r} is a primitive cache of capacity 0, which crashes oneDNN "
            f"(ideep) on the first linear layer; pagedllm uses {DEFAULT_LRU_CACHE_CAPACITY}, ideep's default, "
            f"instead. Set a positive value to bound that cache.")


def apply(environ: MutableMapping[str, str]) -> None:
    """Correct ``environ`` in place (see :func:`guard_lru_cache_capacity`), warning once."""
    message = guard_lru_cache_capacity(environ)
    if message is not None:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
