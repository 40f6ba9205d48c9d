"""Config fields that document themselves.

A dataclass field made with `setting` carries its help text (and, where the default is not a
plain value, the words that say what it is). `service.server.options` turns every such field
into one command-line option and one environment variable, and writes the tables of
docs/config.md, all from the field: its name, type, default and help.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

HELP = "help"
SHOWN_DEFAULT = "shown_default"


def setting(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    shown_default: str | None = None,
) -> Any:
    """A dataclass field with its help text; `shown_default` says what a default that is not
    a plain value means ("the host's name", "from kv_cache_mb")."""
    if not doc:
        raise ValueError("a setting needs its help text")
    metadata = {HELP: doc}
    if shown_default is not None:
        metadata[SHOWN_DEFAULT] = shown_default
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
