"""What a KV tier backend is: records stored under keys, a byte cap, and what it holds now."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class BackendUnavailable(Exception):
    """The backend could not be reached or answered an error: the operation did nothing."""


@dataclass(slots=True, frozen=True)
class BackendUsage:
    entries: int
    bytes: int
    cap_bytes: int


class Backend(Protocol):
    """Called from the tier's threads only (one writer, one reader, possibly at once).

    Keys are `BlockLayout.key` strings (`{tag}/{hash:016x}`). Every method raises
    BackendUnavailable, and nothing else, for what the storage did wrong.
    """

    name: str

    def put(self, key: str, record: bytes) -> None:
        """Store `record` (replacing any under `key`), evicting the least recently used
        entries past the cap; a record larger than the cap is not stored."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The records under `keys` (None where absent), each now the most recently used."""
        ...

    def delete(self, key: str) -> None: ...

    def usage(self) -> BackendUsage:
        """As of the latest operation (no I/O: safe to call for stats at any time)."""
        ...

    def refresh_usage(self) -> None:
        """Bring `usage` up to date with what other processes wrote (the writer calls it
        when idle)."""
        ...

    def close(self) -> None: ...
