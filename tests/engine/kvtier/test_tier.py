"""tier.py against the real backends: what is saved is loaded back as a run, checks drop bad
blocks, and a full, slow or stopped backend costs blocks, never an exception."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import redis
import torch

from service.engine.kvtier.backend import Backend
from service.engine.kvtier.dir_backend import DirBackend
from service.engine.kvtier.redis_backend import RedisBackend
from service.engine.kvtier.tier import WRITER_NICE, KVTier, LoadedRun
from tests.engine.kvtier.conftest import blocks, layout
from tests.redis_process import RedisProcess


def load(tier: KVTier, hashes: list[int], timeout: float = 30.0) -> LoadedRun | None:
    ticket = tier.load(hashes)
    assert ticket.done.wait(timeout), "the load did not finish"
    return ticket.result


def make(backends: list[Backend], **kwargs: object) -> KVTier:
    return KVTier(backends, layout(), **kwargs)  # type: ignore[arg-type]


def test_saved_blocks_load_back_exactly_in_order(tmp_path: Path) -> None:
    tier = make([DirBackend(tmp_path, cap_bytes=1 << 20)])
    try:
        data = blocks(4)
        tier.save([10, 11, 12, 13], data)
        assert tier.flush()
        run = load(tier, [10, 11, 12, 13])
        assert run is not None and run.hashes == [10, 11, 12, 13]
        assert torch.equal(run.data, data)
        s = tier.stats()
        assert (s.blocks_written, s.blocks_loaded, s.blocks_missed) == (4, 4, 0)
    finally:
        tier.close()


def test_a_load_stops_at_the_first_missing_block(tmp_path: Path) -> None:
    tier = make([DirBackend(tmp_path, cap_bytes=1 << 20)])
    try:
        data = blocks(4)
        tier.save([1, 2, 4], data[:, :, [0, 1, 3]])
        tier.flush()
        run = load(tier, [1, 2, 3, 4])
        assert run is not None and run.hashes == [1, 2]
        assert torch.equal(run.data, data[:, :, :2])
        assert load(tier, [3, 4]) is None
        assert tier.stats().blocks_missed == 2 + 2
    finally:
        tier.close()


def test_a_corrupted_block_is_rejected_deleted_and_ends_the_run(tmp_path: Path) -> None:
    backend = DirBackend(tmp_path, cap_bytes=1 << 20)
    tier = make([backend])
    try:
        tier.save([1, 2, 3], blocks(3))
        tier.flush()
        path = backend.path(layout().key(2))
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
        run = load(tier, [1, 2, 3])
        assert run is not None and run.hashes == [1]
        assert tier.stats().blocks_rejected == {"checksum": 1}
        assert not path.exists()
    finally:
        tier.close()


def test_a_foreign_models_record_under_our_key_is_rejected(tmp_path: Path) -> None:
    backend = DirBackend(tmp_path, cap_bytes=1 << 20)
    tier = make([backend])
    other = KVTier([DirBackend(tmp_path / "other", cap_bytes=1 << 20)], layout("other-model"))
    try:
        other.save([5], blocks(1))
        other.flush()
        theirs = DirBackend(tmp_path / "other", cap_bytes=1 << 20)
        [data] = theirs.get_many([layout("other-model").key(5)])
        assert data is not None
        backend.put(layout().key(5), data)  # misplaced: our key, their block
        assert load(tier, [5]) is None
        assert tier.stats().blocks_rejected == {"foreign": 1}
    finally:
        tier.close()
        other.close()


def test_a_block_is_written_once_however_often_it_is_saved(tmp_path: Path) -> None:
    tier = make([DirBackend(tmp_path, cap_bytes=1 << 20)])
    try:
        tier.save([1, 2], blocks(2))
        tier.save([2, 3], blocks(2))
        tier.flush()
        assert tier.stats().blocks_written == 3
    finally:
        tier.close()


def test_writes_past_the_pending_bound_are_dropped_not_waited_for(tmp_path: Path) -> None:
    one_block = layout().raw_bytes
    tier = make([DirBackend(tmp_path, cap_bytes=1 << 20)], max_pending_bytes=2 * one_block)
    try:
        tier.save([1, 2, 3], blocks(3))  # three blocks do not fit a two-block queue
        tier.flush()
        s = tier.stats()
        assert s.writes_dropped == 3 and s.blocks_written == 0
        assert not tier.knows(1)  # a dropped block may be saved again later
    finally:
        tier.close()


def test_the_directory_is_read_before_redis_and_writes_reach_both(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    def redis_backend() -> RedisBackend:
        return RedisBackend(
            redis_url, prefix=redis_prefix, cap_bytes=1 << 20, ttl_s=60, io_timeout_s=2.0
        )

    writer = make([DirBackend(tmp_path / "a", cap_bytes=1 << 20), redis_backend()])
    # Another host: its own (empty) directory, the same Redis.
    reader = make([DirBackend(tmp_path / "b", cap_bytes=1 << 20), redis_backend()])
    try:
        data = blocks(2)
        writer.save([1, 2], data)
        writer.flush()
        assert [b.entries for b in writer.stats().backends] == [2, 2]
        run = load(reader, [1, 2])
        assert run is not None and torch.equal(run.data, data)
    finally:
        writer.close()
        reader.close()


@pytest.mark.server
def test_a_stopped_redis_costs_blocks_not_exceptions(redis_server: RedisProcess) -> None:
    backend = RedisBackend(
        f"unix://{redis_server.socket}", prefix="kv:", cap_bytes=1 << 20, ttl_s=60,
        io_timeout_s=1.0,
    )  # fmt: skip
    tier = make([backend], retry_after_s=60.0)
    try:
        tier.save([1], blocks(1))
        tier.flush()
        redis_server.stop()
        assert load(tier, [1]) is None
        tier.save([2], blocks(1))
        tier.flush()
        s = tier.stats()
        assert s.read_errors == 1 and s.blocks_written == 1
        assert s.writes_dropped == 1  # block 2: no backend up to take it
        assert not s.backends[0].available  # left alone: the next calls do not wait on it
        started = time.monotonic()
        assert load(tier, [1]) is None
        assert time.monotonic() - started < 0.5
    finally:
        tier.close()


@pytest.mark.server
def test_a_stalled_redis_gives_up_within_the_io_timeout(redis_server: RedisProcess) -> None:
    url = f"unix://{redis_server.socket}"
    backend = RedisBackend(url, prefix="kv:", cap_bytes=1 << 20, ttl_s=60, io_timeout_s=0.5)
    tier = make([backend])
    admin = redis.Redis.from_url(url)
    try:
        tier.save([1], blocks(1))
        tier.flush()
        admin.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        started = time.monotonic()
        assert load(tier, [1]) is None
        assert time.monotonic() - started < 2.5
        assert tier.stats().read_errors == 1
    finally:
        admin.close()
        tier.close()


@pytest.mark.server
def test_a_load_past_its_timeout_is_given_up(redis_server: RedisProcess) -> None:
    url = f"unix://{redis_server.socket}"
    backend = RedisBackend(url, prefix="kv:", cap_bytes=1 << 20, ttl_s=60, io_timeout_s=5.0)
    tier = make([backend], load_timeout_s=0.2)
    admin = redis.Redis.from_url(url)
    try:
        admin.execute_command("CLIENT", "PAUSE", 2000, "ALL")
        ticket = tier.load([1])
        time.sleep(0.3)
        assert tier.expired(ticket) and ticket.cancelled
        assert tier.stats().loads_timed_out == 1
        assert ticket.done.wait(10) and ticket.result is None
    finally:
        admin.close()
        tier.close()


def test_the_writer_thread_yields_the_cpu_to_the_engine(tmp_path: Path) -> None:
    tier = make([DirBackend(tmp_path, cap_bytes=1 << 20)])
    try:
        tier.save([1], blocks(1))
        tier.flush()
        writer = tier._writer
        stat = Path(f"/proc/self/task/{writer.native_id}/stat").read_text()
        nice = int(stat.rsplit(")", 1)[1].split()[16])
        assert nice == WRITER_NICE
        assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # the rest of the process unchanged
    finally:
        tier.close()
