"""Special-token strings typed in message contents stay text: they pass the template as private-use
sentinels, and each sentinel is encoded as the plain text it stands for (``split_special_tokens``)."""

from __future__ import annotations

import re
from typing import Callable

_SENTINEL = re.compile("\ue000(\\d+)\ue001")


def special_texts(tokenizer) -> list[str]:
    """The tokenizer's special-token strings, longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found = {t.content for t in decoder.values() if getattr(t, "special", False)}
    found.update(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted((s for s in found if s), key=len, reverse=True)


def mask_special_texts(messages: list[dict], specials: list[str]) -> tuple[list[dict], list[str]]:
    """``messages`` with special-token strings in text contents as sentinels; sentinel i is ``replaced[i]``."""
    if not specials:
        return messages, []
    pattern = re.compile("|".join(map(re.escape, specials)))
    replaced: list[str] = []

    def sentinel(m: re.Match) -> str:
        replaced.append(m.group(0))
        return f"\ue000{len(replaced) - 1}\ue001"

    masked = [{**m, "content": pattern.sub(sentinel, m["content"])}
              if isinstance(m.get("content"), str) and pattern.search(m["content"]) else m for m in messages]
    return masked, replaced


def encode_rendered(encode: Callable[..., list[int]], text: str, replaced: list[str]) -> list[int]:
    """``encode(text, add_special_tokens=False)``, each sentinel encoded as plain text."""
    if not replaced:
        return encode(text, add_special_tokens=False)
    ids, start = [], 0
    for m in _SENTINEL.finditer(text):
        index = int(m.group(1))
        if index >= len(replaced):
            continue  # a user's look-alike: left in the surrounding text
        if m.start() > start:
            ids += encode(text[start:m.start()], add_special_tokens=False)
        ids += encode(replaced[index], add_special_tokens=False, split_special_tokens=True)
        start = m.end()
    return ids + (encode(text[start:], add_special_tokens=False) if start < len(text) else [])
