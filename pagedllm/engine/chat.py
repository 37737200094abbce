"""Validation and normalization of OpenAI-style chat conversations (no torch)."""

from __future__ import annotations

import json

VALID_ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize_conversation(conversation: list[dict]) -> list[dict]:
    """Check roles and flatten text-part content to strings.

    ``content`` may be a string or a list of ``{"type": "text", "text": ...}`` parts
    (joined with newlines, as vLLM does). Raises ValueError naming the message index for
    an empty conversation, a non-dict message, an unknown role, non-text content, or missing
    content outside an assistant turn (OpenAI requires it there too).
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
        if msg.get("content") is None and role != "assistant":  # only an assistant turn may be tool calls alone
            raise ValueError(f"messages[{i}].content is required for a {role} message")
        norm = {"role": role, "content": _content_text(msg.get("content"), i)}
        if role == "assistant" and msg.get("tool_calls"):
            norm["tool_calls"] = _tool_calls(msg["tool_calls"], i)
        if role == "tool" and msg.get("tool_call_id") is not None:
            norm["tool_call_id"] = str(msg["tool_call_id"])
        if isinstance(msg.get("name"), str):
            norm["name"] = msg["name"]
        out.append(norm)
    return out


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant turn's tool calls for the template: ``function.arguments`` as a dict when
    it is JSON text (templates such as Qwen's render it with ``tojson``), as vLLM does."""
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"messages[{i}].tool_calls entries need function.name")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append({**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}})
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
