"""Message contents as text: a special-token string typed in a message never becomes a control token.

The rendered template is tokenized with special tokens parsed, as it must be (the template writes
its own control tokens as text). Special-token strings inside message contents are first swapped
for private-use sentinels; the rendered text is cut at them and each is encoded as the plain text
it stood for (``split_special_tokens``). A conversation without such strings is tokenized as before.
"""

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
    """``messages`` with every special-token string in a text content replaced by a sentinel, and
    the strings replaced (sentinel ``i`` stands for ``strings[i]``)."""
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
    """Token ids of a rendered template: ``encode(text, add_special_tokens=False)``, with each
    sentinel encoded as the plain text of the string it replaced."""
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
