"""A local directory of blocks: one file per block, written atomically, capped in bytes.

    {root}/{tag}/{hash[:2]}/{hash}.kvb

NOTE (atomic writes): a record is written to a temporary file in its final directory and
renamed over the name (os.replace), so a reader sees a whole record or none. Files are not
fsynced: a record cut short by a power loss fails its length or checksum check and is
recomputed (record.py), which is cheaper than an fsync per block.
NOTE (LRU and cap): the index (file -> size, least recently used first) is built from the
files' mtimes at start and kept as blocks are written and read; a read sets the file's mtime,
so the order survives restarts. Past the cap the least recently used files are deleted. Several
processes may share one directory: when over the cap, the index is rebuilt from the directory
(at most every RESCAN_S) before evicting, so each evicts by what is really there.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from service.engine.kvtier.backend import BackendUnavailable, BackendUsage

SUFFIX = ".kvb"
RESCAN_S = 5.0


class DirBackend:
    name = "dir"

    def __init__(self, root: Path, *, cap_bytes: int) -> None:
        self.root = Path(root)
        self.cap_bytes = cap_bytes
        self._lock = threading.Lock()  # the writer and the reader thread share the index
        self._index: OrderedDict[Path, int] = OrderedDict()
        self._bytes = 0
        self._last_scan = 0.0
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"kv tier directory {self.root}: {exc}") from None
        self._rescan()

    def path(self, key: str) -> Path:
        tag, _, name = key.partition("/")
        return self.root / tag / name[:2] / f"{name}{SUFFIX}"

    def put(self, key: str, record: bytes) -> None:
        if len(record) > self.cap_bytes:
            return
        path = self.path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(record)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):  # removed by another process first
                tmp.unlink(missing_ok=True)
            raise BackendUnavailable(f"write {path}: {exc}") from None
        with self._lock:
            self._bytes -= self._index.pop(path, 0)
            self._index[path] = len(record)
            self._bytes += len(record)
            over = self._bytes > self.cap_bytes
        if over:
            self._evict()

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            path = self.path(key)
            try:
                with open(path, "rb", opener=_without_blocking) as f:
                    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                        raise FileNotFoundError(path)  # a FIFO or device there is no record
                    data = f.read()
                os.utime(path)  # most recently used, across restarts too
            except FileNotFoundError:
                with self._lock:
                    self._bytes -= self._index.pop(path, 0)
                out.append(None)
                continue
            except OSError as exc:
                raise BackendUnavailable(f"read {path}: {exc}") from None
            with self._lock:
                self._bytes -= self._index.pop(path, 0)
                self._index[path] = len(data)
                self._bytes += len(data)
            out.append(data)
        return out

    def delete(self, key: str) -> None:
        path = self.path(key)
        with self._lock:
            self._bytes -= self._index.pop(path, 0)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise BackendUnavailable(f"delete {path}: {exc}") from None

    def usage(self) -> BackendUsage:
        with self._lock:
            return BackendUsage(len(self._index), self._bytes, self.cap_bytes)

    def refresh_usage(self) -> None:
        if time.monotonic() - self._last_scan > RESCAN_S:
            self._rescan()

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ internals

    def _evict(self) -> None:
        if time.monotonic() - self._last_scan > RESCAN_S:
            self._rescan()
        victims: list[Path] = []
        with self._lock:
            while self._bytes > self.cap_bytes and self._index:
                path, size = self._index.popitem(last=False)
                self._bytes -= size
                victims.append(path)
        for path in victims:
            with contextlib.suppress(OSError):  # removed by another process first
                path.unlink(missing_ok=True)

    def _rescan(self) -> None:
        """Rebuild the index from the files there, least recently used first."""
        found: list[tuple[float, Path, int]] = []
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                if not name.endswith(SUFFIX) or name.startswith("."):
                    continue
                path = Path(dirpath) / name
                with contextlib.suppress(OSError):  # removed by another process first
                    st = path.stat()
                    found.append((st.st_mtime, path, st.st_size))
        found.sort(key=lambda item: item[0])
        with self._lock:
            self._index = OrderedDict((path, size) for _, path, size in found)
            self._bytes = sum(size for _, _, size in found)
            self._last_scan = time.monotonic()


def _without_blocking(path: str, flags: int) -> int:
    """Open for reading without waiting: a FIFO planted where a record belongs would otherwise
    hold the reader (and every load after it) until a writer came. Regular files ignore it."""
    return os.open(path, flags | os.O_NONBLOCK)
