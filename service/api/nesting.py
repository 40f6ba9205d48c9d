"""How deep a decoded request or frame nests, counted without recursion.

NOTE (nesting): a body or frame is decoded whole before any field is looked at, and its
free-form fields (a JSON Schema, a tool's parameters, `tool_choice`, `metadata`...) are then
walked, converted, printed into messages and compiled, each by code that recurses. A value
nested deeper than MAX_NESTING is refused at once, so none of that code ever meets one (a
decoder that meets one past its own limit raises RecursionError, refused the same way).
"""

from __future__ import annotations

from typing import Any

import msgspec

from service.engine.params import MAX_SCHEMA_DEPTH

_CONTAINERS = (msgspec.Struct, dict, list, tuple)
# A JSON Schema may nest MAX_SCHEMA_DEPTH levels; the request around it adds a few.
MAX_NESTING = MAX_SCHEMA_DEPTH + 16


def too_deep(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether `value` (a msgspec Struct, dicts, lists and scalars) nests more than `limit`
    containers deep."""
    stack: list[tuple[Any, int]] = [(value, 0)] if isinstance(value, _CONTAINERS) else []
    while stack:
        node, depth = stack.pop()
        if depth >= limit:
            return True
        if isinstance(node, msgspec.Struct):
            children: Any = (getattr(node, name) for name in node.__struct_fields__)
        elif isinstance(node, dict):
            children = node.values()
        else:
            children = node
        stack.extend((child, depth + 1) for child in children if isinstance(child, _CONTAINERS))
    return False


def nesting_message(limit: int = MAX_NESTING) -> str:
    return f"it nests deeper than {limit} levels"
