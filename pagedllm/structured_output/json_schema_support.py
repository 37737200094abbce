"""JSON-schema features the grammar backend would silently drop: merged exactly, or refused by name.

xgrammar compiles some keywords to "anything" with only a log line (a multi-branch ``allOf`` becomes
any JSON value; a ``$ref`` that is not local is skipped), so a 200 would carry output the schema
forbids. ``supported_schema`` walks the schema once: an ``allOf`` whose branches are plain object
schemas (or local ``$ref``s to them) with no conflicting property is merged into one object schema
(exact: the same instances are valid); every other dropped feature raises ValueError naming it and
where it is. Pure Python: runs on the request path in time linear in the schema.
"""

from __future__ import annotations

import copy
from typing import Any

# keywords xgrammar 0.2 ignores (the instance is not checked against them)
DROPPED_KEYWORDS = ("not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
                    "dependentRequired", "dependencies", "unevaluatedItems")
# object-level keywords besides which an anyOf / oneOf / allOf is ignored by xgrammar
_OBJECT_KEYWORDS = ("properties", "required", "additionalProperties", "patternProperties")
# what an allOf branch may hold to be merged exactly
_MERGEABLE = {"type", "properties", "required", "title", "description"}
_ANNOTATIONS = {"title", "description", "$defs", "definitions", "$schema", "$id", "$comment", "examples",
                "default"}


def supported_schema(schema: Any) -> Any:
    """``schema`` with exact ``allOf`` merges applied (a copy when changed). Raises ValueError naming
    the first feature the backend would drop, with its JSON pointer."""
    if not isinstance(schema, dict):
        return schema
    root = copy.deepcopy(schema)
    return _walk(root, root, "#", set())


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_NOT_SCHEMAS = ("enum", "const", "examples", "default", "required")


def _walk(node: Any, root: dict, where: str, seen: set[int]) -> Any:
    """Check (and merge) one schema node, then every schema inside it."""
    if isinstance(node, bool) or not isinstance(node, dict) or id(node) in seen:
        return node
    seen.add(id(node))
    _check_keywords(node, where)
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        node = _merge_all_of(node, root, where)
    for key, value in list(node.items()):
        if key in _NOT_SCHEMAS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            node[key] = {name: _walk(sub, root, f"{where}/{key}/{name}", seen) for name, sub in value.items()}
        elif isinstance(value, list):
            node[key] = [_walk(sub, root, f"{where}/{key}/{i}", seen) for i, sub in enumerate(value)]
        elif isinstance(value, dict):
            node[key] = _walk(value, root, f"{where}/{key}", seen)
    return node


def _check_keywords(node: dict, where: str) -> None:
    for key in DROPPED_KEYWORDS:
        if key in node:
            raise ValueError(f"the JSON schema keyword '{key}' (at {where}) is not supported: the grammar "
                             "would not enforce it")
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        raise ValueError(f"the $ref {ref!r} (at {where}) is not supported: only local references "
                         "('#/...') are resolved, remote ones are never fetched")
    for combinator in ("anyOf", "oneOf"):
        if combinator in node and any(k in node for k in _OBJECT_KEYWORDS):
            raise ValueError(f"'{combinator}' beside object keywords (at {where}) is not supported: the "
                             "grammar would drop one of them; move the properties into each branch")


def _merge_all_of(node: dict, root: dict, where: str) -> dict:
    """One object schema equal to the conjunction of ``node``'s branches (and its own object keywords)."""
    rest = {k: v for k, v in node.items() if k != "allOf"}
    branches = [_resolve(b, root, f"{where}/allOf/{i}") for i, b in enumerate(node["allOf"])]
    own = {k: v for k, v in rest.items() if k not in _ANNOTATIONS}
    if own:
        branches.append(own)
    merged: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
    for i, branch in enumerate(branches):
        extra = set(branch) - _MERGEABLE
        if extra or branch.get("type", "object") != "object":
            what = ", ".join(sorted(extra)) if extra else f"type {branch.get('type')!r}"
            raise ValueError(f"'allOf' with several branches (at {where}) is supported only for object "
                             f"schemas with properties and required; branch {i} has {what}")
        for name, prop in branch.get("properties", {}).items():
            if name in merged["properties"] and merged["properties"][name] != prop:
                raise ValueError(f"'allOf' (at {where}) defines property {name!r} differently in two branches")
            merged["properties"][name] = prop
        merged["required"] += [r for r in branch.get("required", []) if r not in merged["required"]]
    for key in _ANNOTATIONS & set(rest):
        merged[key] = rest[key]
    return merged


def _resolve(branch: Any, root: dict, where: str) -> dict:
    """A branch with its local ``$ref`` followed (a ref with siblings is not merged)."""
    for _ in range(32):
        if not isinstance(branch, dict) or set(branch) != {"$ref"}:
            break
        branch = _pointer(root, branch["$ref"], where)
    if not isinstance(branch, dict):
        raise ValueError(f"'allOf' branch at {where} is not a schema object")
    return branch


def _pointer(root: dict, ref: str, where: str) -> Any:
    if not (ref == "#" or ref.startswith("#/")):
        raise ValueError(f"the $ref {ref!r} (at {where}) is not supported: only local references are resolved")
    node: Any = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise ValueError(f"the $ref {ref!r} (at {where}) points at nothing")
    return node
