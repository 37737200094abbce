"""Name → parser class lookups shared by the tool-call and reasoning parser registries."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def lookup(registry: dict[str, T], name: str, kind: str) -> T:
    """``registry[name]``. Raises ValueError naming ``kind`` and listing the known names."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(registry))}") from None


def detect(registry: dict[str, T], chat_template: str | None) -> T | None:
    """The first class (in registry order) whose ``matches_template(chat_template)`` is true, or None."""
    if not chat_template:
        return None
    return next((cls for cls in registry.values() if cls.matches_template(chat_template)), None)
