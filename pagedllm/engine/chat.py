"""Validation and normalization of OpenAI-style chat conversations (no torch)."""

from __future__ import annotations

VALID_ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize_conversation(conversation: list[dict]) -> list[dict]:
    """Check roles and flatten text-part content to strings.

    ``content`` may be a string or a list of ``{"type": "text", "text": ...}`` parts
    (joined with newlines, as vLLM does). Raises ValueError naming the message index for
    an empty conversation, a non-dict message, an unknown role, or non-text content.
    """
    if not isinstance(conversation, list) or not conversation:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(conversation):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in VALID_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(VALID_ROLES)}; got {role!r}")
        out.append({"role": role, "content": _content_text(msg.get("content"), i)})
    return out


def _content_text(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ValueError(f"messages[{i}].content: only text parts are supported, got {part!r}")
        return "\n".join(parts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
