"""A request body's fields that no field of the request matches.

NOTE (unknown fields): refused by default, a 400 naming the field, as OpenAI's own API
answers (`--unknown-request-fields refuse`): a misspelt option (`max_token`, `temprature`)
would otherwise silently do nothing, and a client would read an answer that ignored what it
asked for as the answer it asked for. Some clients send fields of other servers (vLLM's
extras this server lacks, a framework's own keys) and cannot be changed; for them,
`--unknown-request-fields ignore` drops each unknown field, wherever it sits in the body,
and answers, as vLLM does, with a warning in the log (at most one a minute, counting the
rest) naming the fields, so that the operator still sees them.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

log = logging.getLogger(__name__)

# More unknown fields than this in one body: refused even when ignoring (each costs a pass).
MAX_IGNORED = 32
WARN_EVERY_S = 60.0

T = TypeVar("T")

_UNKNOWN = re.compile(
    r"^Object contains unknown field `(?P<name>[^`]*)`(?: - at `\$(?P<at>[^`]*)`)?$"
)
_STEP = re.compile(r"\.(?P<key>[A-Za-z_][A-Za-z0-9_]*)|\[(?P<index>\d+)\]")


class ThrottledWarning:
    """A warning logged at most once per `interval_s`; those held back are counted in the next."""

    def __init__(
        self, interval_s: float = WARN_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.held = 0
        self._last: float | None = None

    def warn(self, message: str) -> bool:
        """Log `message` unless one was logged within `interval_s`; whether it was."""
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            self.held += 1
            return False
        more = f" ({self.held} more such requests since the last warning)" if self.held else ""
        log.warning("%s%s", message, more)
        self._last, self.held = now, 0
        return True


IGNORED = ThrottledWarning()


def unknown_field(exc: msgspec.ValidationError) -> str | None:
    """The body's path to the field `exc` is about (`messages[0].bar`), if it is an unknown
    field's error."""
    match = _UNKNOWN.match(str(exc))
    if match is None:
        return None
    at = match["at"] or ""
    return f"{at.removeprefix('.')}.{match['name']}" if at else match["name"]


def decode(body: bytes, kind: type[T], what: str, ignore_unknown: bool) -> T:
    """`body` (JSON) as a `kind`; with `ignore_unknown`, a field no `kind` has is dropped
    rather than refused (NOTE (unknown fields)). msgspec's errors are the caller's to word."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        if not ignore_unknown or unknown_field(exc) is None:
            raise
        return convert_ignoring(msgspec.json.decode(body), kind, what)


def convert_ignoring(body: Any, kind: type[T], what: str) -> T:
    """`body` (parsed JSON) as a `kind`, each unknown field dropped: NOTE (unknown fields).
    ValidationError for any other fault, or past MAX_IGNORED unknown fields."""
    ignored: list[str] = []
    while True:
        try:
            req = msgspec.convert(body, type=kind)
            break
        except msgspec.ValidationError as exc:
            match = _UNKNOWN.match(str(exc))
            parent = None if match is None else _at(body, match["at"] or "")
            if match is None or not isinstance(parent, dict) or len(ignored) >= MAX_IGNORED:
                raise
            del parent[match["name"]]
            ignored.append(unknown_field(exc) or match["name"])
    if ignored:
        names = ", ".join(repr(name[:64]) for name in ignored)
        IGNORED.warn(f"a {what} had fields no request has, ignored: {names}")
    return req


def _at(body: Any, path: str) -> Any:
    """What `path` (msgspec's `.key[0].key`) names in `body`; None where it names nothing."""
    node, end = body, 0
    for step in _STEP.finditer(path):
        if step.start() != end:
            return None
        end = step.end()
        if step["key"] is not None:
            node = node.get(step["key"]) if isinstance(node, dict) else None
        else:
            index = int(step["index"])
            node = node[index] if isinstance(node, list) and index < len(node) else None
    return node if end == len(path) else None
