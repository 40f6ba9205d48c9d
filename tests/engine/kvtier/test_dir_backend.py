"""dir_backend.py on a real temporary directory: atomic files, the byte cap, LRU order that
survives a restart, and a directory it cannot write to."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from service.engine.kvtier.backend import BackendUnavailable
from service.engine.kvtier.dir_backend import DirBackend

TAG = "00112233aabbccdd"


def key(i: int) -> str:
    return f"{TAG}/{i:016x}"


def test_a_record_written_is_read_back_and_no_temporary_file_is_left(tmp_path: Path) -> None:
    backend = DirBackend(tmp_path, cap_bytes=1 << 20)
    backend.put(key(1), b"x" * 100)
    assert backend.get_many([key(1), key(2)]) == [b"x" * 100, None]
    files = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert files == [f"{1:016x}.kvb"]
    assert backend.usage().entries == 1 and backend.usage().bytes == 100


def test_past_the_cap_the_least_recently_used_are_evicted(tmp_path: Path) -> None:
    backend = DirBackend(tmp_path, cap_bytes=300)
    for i in range(3):
        backend.put(key(i), bytes([i]) * 100)
    backend.get_many([key(0)])  # 0 is now the most recently used; 1 the least
    backend.put(key(3), b"3" * 100)
    assert backend.get_many([key(i) for i in range(4)]) == [
        b"\0" * 100,
        None,
        b"\2" * 100,
        b"3" * 100,
    ]
    assert backend.usage().bytes == 300


def test_a_record_larger_than_the_cap_is_not_stored(tmp_path: Path) -> None:
    backend = DirBackend(tmp_path, cap_bytes=50)
    backend.put(key(1), b"x" * 51)
    assert backend.get_many([key(1)]) == [None]


def test_a_new_process_finds_the_blocks_and_their_order(tmp_path: Path) -> None:
    first = DirBackend(tmp_path, cap_bytes=1000)
    for i in range(3):
        first.put(key(i), b"y" * 100)
        old = time.time() - 100 + i  # mtimes a second apart: 0 oldest
        os.utime(first.path(key(i)), (old, old))
    second = DirBackend(tmp_path, cap_bytes=200)  # a smaller cap: evicts at its first write
    assert second.usage().entries == 3
    second.put(key(9), b"z" * 50)
    assert second.get_many([key(0), key(1), key(2), key(9)]) == [None, None, b"y" * 100, b"z" * 50]


def test_delete_removes_the_file(tmp_path: Path) -> None:
    backend = DirBackend(tmp_path, cap_bytes=1000)
    backend.put(key(1), b"x")
    backend.delete(key(1))
    assert backend.get_many([key(1)]) == [None]
    assert backend.usage().entries == 0


def test_a_directory_that_cannot_be_written_raises_backend_unavailable(tmp_path: Path) -> None:
    backend = DirBackend(tmp_path, cap_bytes=1000)
    (tmp_path / TAG).write_text("a file where a directory should be")
    with pytest.raises(BackendUnavailable):
        backend.put(key(1), b"x")
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_a_root_that_is_a_file_is_refused_at_start(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="kv tier directory"):
        DirBackend(tmp_path / "f", cap_bytes=1000)


@pytest.mark.timeout(60)  # a blocking open never returns: the timeout is the failure
def test_a_fifo_where_a_record_belongs_reads_as_missing_at_once(tmp_path: Path) -> None:
    """Nothing writes to it: a blocking open would hold the reader, and every load after it."""
    backend = DirBackend(tmp_path, cap_bytes=1 << 20)
    backend.put(key(2), b"y" * 10)
    fifo = backend.path(key(1))
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    assert backend.get_many([key(1), key(2)]) == [None, b"y" * 10]
