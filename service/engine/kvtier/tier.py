"""KVTier: what the engine hands blocks to and asks blocks of, and the threads doing the I/O.

The engine thread calls `save` (never waits: the blocks are queued, or dropped past
`max_pending_mb`) and `load` (returns a ticket at once; the reader thread fills it), through
the engine's connector (connector.py) only. Only the tier's own threads touch the backends.

NOTE (several backends): writes go to every backend; a read asks them in order (the local
directory before a shared Redis), each for the blocks the ones before it lacked. The run a
load returns is the leading blocks found, in order: a block after a missing one is no use to a
prefix.
NOTE (known blocks): the tier remembers (bounded, least recently used) the hashes it wrote or
read, so that a block saved when its turn was stored is not written again when it later
leaves the CPU pool. A remembered block may since have been evicted or expired: then it is
recomputed when next needed, never wrongly used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

from service.engine.kvtier import record
from service.engine.kvtier.backend import Backend, BackendUnavailable, BackendUsage
from service.engine.kvtier.config import KVTierConfig
from service.engine.kvtier.dir_backend import DirBackend
from service.engine.kvtier.record import BlockLayout, Rejected
from service.engine.kvtier.redis_backend import RedisBackend
from service.engine.values import BackendStats, KVTierStats

log = logging.getLogger(__name__)

KNOWN_LIMIT = 1 << 17  # hashes remembered as stored (8 bytes each, plus the dict's)
READ_CHUNK = 16  # blocks asked of a backend at once: a miss stops the run early
IDLE_REFRESH_S = 5.0  # the writer refreshes backends' usage this often when idle
CLOSE_TIMEOUT_S = 30.0  # at shutdown, pending writes get this long
# The writer runs at this nice level (Linux: per thread), so that encoding a stored
# conversation yields the CPU to the engine's steps; reads stay at the engine's priority,
# since a sequence waits on them.
WRITER_NICE = 10


@dataclass(slots=True)
class LoadedRun:
    """The leading blocks of a load that were found, decoded and checked."""

    hashes: list[int]
    data: torch.Tensor  # [L, 2, n, bs, Hkv, D] on the host, in the pool's dtype

    def __len__(self) -> int:
        return len(self.hashes)

    def tail(self, start: int) -> LoadedRun:
        return LoadedRun(self.hashes[start:], self.data[:, :, start:])


@dataclass(slots=True, eq=False)
class LoadTicket:
    """One asynchronous load: `done` is set once `result` is final (None: nothing usable)."""

    hashes: list[int]
    started: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    result: LoadedRun | None = None
    cancelled: bool = False  # the sequence gave up on it (timed out, aborted)


@dataclass(slots=True)
class _Backend:
    backend: Backend
    down_until: float = 0.0

    def available(self, now: float) -> bool:
        return now >= self.down_until


class KVTier:
    def __init__(
        self,
        backends: list[Backend],
        layout: BlockLayout,
        *,
        codec: str = "raw",
        max_pending_bytes: int = 256 << 20,
        load_timeout_s: float = 10.0,
        retry_after_s: float = 5.0,
    ) -> None:
        if not backends:
            raise ValueError("a KV tier needs at least one backend")
        record.check_codec_available(codec)
        self.layout = layout
        self.codec = codec
        self.load_timeout_s = load_timeout_s
        self.retry_after_s = retry_after_s
        self.max_pending_bytes = max_pending_bytes
        self._backends = [_Backend(b) for b in backends]
        self._known: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()  # _known and the pending count
        self._pending_bytes = 0
        self._pending_blocks = 0
        self._writes: queue.SimpleQueue[tuple[list[int], torch.Tensor] | None] = queue.SimpleQueue()
        self._reads: queue.SimpleQueue[LoadTicket | None] = queue.SimpleQueue()
        # Set whenever a load finishes, so an engine with nothing else to run can wait on it.
        self.load_finished = threading.Event()
        self._written = self._bytes_written = self._dropped = self._write_errors = 0
        self._loads = self._timed_out = self._loaded = self._missed = self._read_errors = 0
        self._rejected: Counter[str] = Counter()
        self._write_s = self._read_s = 0.0
        self._writer = threading.Thread(target=self._write_loop, name="kvtier-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="kvtier-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    @classmethod
    def open(cls, config: KVTierConfig, layout: BlockLayout) -> KVTier:
        """The backends `config` names: the directory first, then Redis."""
        backends: list[Backend] = []
        if config.directory is not None:
            backends.append(DirBackend(config.directory, cap_bytes=config.directory_mb << 20))
        if config.redis_url is not None:
            backends.append(
                RedisBackend(
                    config.redis_url,
                    prefix=config.redis_prefix,
                    cap_bytes=config.redis_mb << 20,
                    ttl_s=config.ttl_s,
                    io_timeout_s=config.io_timeout_s,
                )
            )
        return cls(
            backends,
            layout,
            codec=config.codec,
            max_pending_bytes=config.max_pending_mb << 20,
            load_timeout_s=config.load_timeout_s,
            retry_after_s=config.retry_after_s,
        )

    # ------------------------------------------------------------------ engine thread

    def knows(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._known

    def save(self, hashes: list[int], blocks: torch.Tensor) -> None:
        """Queue blocks [L, 2, n, bs, Hkv, D] (a copy the caller no longer touches) for
        writing; those already known are skipped, and all of them dropped if the queue is
        full. Never blocks."""
        keep = [i for i, h in enumerate(hashes) if not self.knows(h)]
        if not keep:
            return
        if len(keep) < len(hashes):
            hashes = [hashes[i] for i in keep]
            blocks = blocks[:, :, keep]
        size = len(hashes) * self.layout.raw_bytes
        with self._lock:
            if self._pending_bytes + size > self.max_pending_bytes:
                self._dropped += len(hashes)
                return
            self._pending_bytes += size
            self._pending_blocks += len(hashes)
            self._remember(hashes)
        self._writes.put((hashes, blocks))

    def load(self, hashes: list[int]) -> LoadTicket:
        """Start fetching the run of blocks `hashes` (in prompt order); returns at once."""
        ticket = LoadTicket(list(hashes))
        self._loads += 1
        self._reads.put(ticket)
        return ticket

    def expired(self, ticket: LoadTicket) -> bool:
        """True (and the ticket given up) once it has waited past the load timeout."""
        if ticket.done.is_set() or time.monotonic() - ticket.started < self.load_timeout_s:
            return False
        ticket.cancelled = True
        self._timed_out += 1
        return True

    def stats(self) -> KVTierStats:
        now = time.monotonic()
        return KVTierStats(
            codec=self.codec,
            backends=[_backend_stats(b, now) for b in self._backends],
            blocks_written=self._written,
            bytes_written=self._bytes_written,
            writes_dropped=self._dropped,
            write_errors=self._write_errors,
            pending_writes=self._pending_blocks,
            loads=self._loads,
            loads_timed_out=self._timed_out,
            blocks_loaded=self._loaded,
            blocks_missed=self._missed,
            blocks_rejected=dict(self._rejected),
            read_errors=self._read_errors,
            write_seconds=self._write_s,
            read_seconds=self._read_s,
        )

    def flush(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every queued write is done (or `timeout`); True if none is left."""
        deadline = time.monotonic() + timeout
        while self._pending_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._pending_blocks

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is queued (up to `timeout`), stop the threads, close the backends."""
        self._writes.put(None)
        self._reads.put(None)
        self._writer.join(timeout)
        self._reader.join(1.0)
        if self._pending_blocks:
            log.warning("kv tier: %d blocks left unwritten at shutdown", self._pending_blocks)
        for b in self._backends:
            b.backend.close()

    # ------------------------------------------------------------------ writer thread

    def _write_loop(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        while True:
            try:
                item = self._writes.get(timeout=IDLE_REFRESH_S)
            except queue.Empty:
                self._refresh_usage()
                continue
            if item is None:
                return
            hashes, blocks = item
            start = time.perf_counter()
            for i, h in enumerate(hashes):
                try:
                    self._write_one(h, blocks[:, :, i])
                except Exception:  # a bug here must cost this block, not the tier
                    log.exception("kv tier: writing block %016x failed", h)
                    self._write_errors += 1
                    self._forget(h)
                finally:
                    with self._lock:
                        self._pending_bytes -= self.layout.raw_bytes
                        self._pending_blocks -= 1
            self._write_s += time.perf_counter() - start

    def _write_one(self, block_hash: int, block: torch.Tensor) -> None:
        data = record.encode(block_hash, block.contiguous(), self.layout, self.codec)
        key = self.layout.key(block_hash)
        stored = tried = False
        now = time.monotonic()
        for b in self._backends:
            if not b.available(now):
                continue
            tried = True
            try:
                b.backend.put(key, data)
                stored = True
            except BackendUnavailable as exc:
                self._failed(b, exc)
                self._write_errors += 1
        if stored:
            self._written += 1
            self._bytes_written += len(data)
        else:
            if not tried:  # every backend is left alone after a failure: the block is lost
                with self._lock:  # `save` counts drops too, on the engine thread
                    self._dropped += 1
            self._forget(block_hash)

    def _refresh_usage(self) -> None:
        now = time.monotonic()
        for b in self._backends:
            if b.available(now):
                try:
                    b.backend.refresh_usage()
                except BackendUnavailable as exc:
                    self._failed(b, exc)

    # ------------------------------------------------------------------ reader thread

    def _read_loop(self) -> None:
        while True:
            ticket = self._reads.get()
            if ticket is None:
                return
            start = time.perf_counter()
            try:
                if not ticket.cancelled:
                    ticket.result = self._read_run(ticket)
            except Exception:  # a bug here must cost this load, not the engine
                log.exception("kv tier: a load failed")
                self._read_errors += 1
                ticket.result = None
            finally:
                self._read_s += time.perf_counter() - start
                ticket.done.set()
                self.load_finished.set()

    def _read_run(self, ticket: LoadTicket) -> LoadedRun | None:
        hashes = ticket.hashes
        L, two, bs, h, d = self.layout.shape
        # Blocks are decoded straight into place (pages are touched only as they are filled).
        run = torch.empty((L, two, len(hashes), bs, h, d), dtype=self.layout.dtype)
        found = 0
        while found < len(hashes) and not ticket.cancelled:
            chunk = hashes[found : found + READ_CHUNK]
            n = self._read_chunk(chunk, run[:, :, found : found + len(chunk)])
            found += n
            if n < len(chunk):
                self._missed += len(hashes) - found
                break
        if not found or ticket.cancelled:
            return None
        with self._lock:
            self._remember(hashes[:found])
        self._loaded += found
        return LoadedRun(hashes[:found], run[:, :, :found])

    def _read_chunk(self, hashes: list[int], out: torch.Tensor) -> int:
        """How many leading blocks of `hashes` some backend holds and pass every check; they
        are decoded into `out` [L, 2, len(hashes), bs, Hkv, D]."""
        got = [False] * len(hashes)
        now = time.monotonic()
        for b in self._backends:
            missing = [i for i, ok in enumerate(got) if not ok]
            if not missing:
                break
            if not b.available(now):
                continue
            keys = [self.layout.key(hashes[i]) for i in missing]
            try:
                records = b.backend.get_many(keys)
            except BackendUnavailable as exc:
                self._failed(b, exc)
                self._read_errors += 1
                continue
            for i, key, data in zip(missing, keys, records, strict=True):
                if data is None:
                    continue
                try:
                    record.decode(data, hashes[i], self.layout, out[:, :, i])
                    got[i] = True
                except Rejected as exc:
                    self._rejected[exc.reason] += 1
                    log.warning("kv tier (%s): dropped block %s: %s", b.backend.name, key, exc)
                    self._forget(hashes[i])
                    try:
                        b.backend.delete(key)
                    except BackendUnavailable as exc2:
                        self._failed(b, exc2)
        return got.index(False) if False in got else len(got)

    # ------------------------------------------------------------------ internals

    def _remember(self, hashes: list[int]) -> None:
        """Under the lock."""
        for h in hashes:
            self._known[h] = None
            self._known.move_to_end(h)
        while len(self._known) > KNOWN_LIMIT:
            self._known.popitem(last=False)

    def _forget(self, block_hash: int) -> None:
        with self._lock:
            self._known.pop(block_hash, None)

    def _failed(self, b: _Backend, exc: BackendUnavailable) -> None:
        if b.available(time.monotonic()):
            log.warning(
                "kv tier (%s) failed, left alone for %.0fs: %s",
                b.backend.name,
                self.retry_after_s,
                exc,
            )
        b.down_until = time.monotonic() + self.retry_after_s


def _backend_stats(b: _Backend, now: float) -> BackendStats:
    usage: BackendUsage = b.backend.usage()
    return BackendStats(
        name=b.backend.name,
        entries=usage.entries,
        bytes=usage.bytes,
        cap_bytes=usage.cap_bytes,
        available=b.available(now),
    )
