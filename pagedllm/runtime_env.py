"""Environment variables of torch's CPU libraries corrected before they are read (no torch here)."""

from __future__ import annotations

import re
import warnings
from typing import MutableMapping

LRU_CACHE_CAPACITY_ENV = "LRU_CACHE_CAPACITY"
# ideep's (and oneDNN's) own default
DEFAULT_LRU_CACHE_CAPACITY = 1024


def _c_atoi(text: str) -> int:
    m = re.match(r"\s*([+-]?\d+)", text)
    return int(m.group(1)) if m else 0


def guard_lru_cache_capacity(environ: MutableMapping[str, str]) -> str | None:
    """Replace an ``LRU_CACHE_CAPACITY`` that ideep's ``atoi`` reads as 0; return the warning, or None.

    A capacity of 0 makes the first oneDNN primitive (a packed linear) crash the process. ideep reads it
    lazily, at that first primitive, so correcting it after torch is imported still holds.
    """
    value = environ.get(LRU_CACHE_CAPACITY_ENV)
    if value is None or _c_atoi(value) != 0:
        return None
    environ[LRU_CACHE_CAPACITY_ENV] = str(DEFAULT_LRU_CACHE_CAPACITY)
    return (f"{LRU_CACHE_CAPACITY_ENV}={value!r} is a primitive cache of capacity 0, which crashes oneDNN "
            f"(ideep) on the first linear layer; pagedllm uses {DEFAULT_LRU_CACHE_CAPACITY}, ideep's default, "
            f"instead. Set a positive value to bound that cache.")


def apply(environ: MutableMapping[str, str]) -> None:
    """Correct ``environ`` in place, warning once."""
    message = guard_lru_cache_capacity(environ)
    if message is not None:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
