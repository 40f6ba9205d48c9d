"""redis_backend.py on the Redis at 127.0.0.1:6379 (a unique prefix) and on a private
redis-server that the test stops: TTL, one shared byte cap, LRU, and a server that is gone."""

from __future__ import annotations

import time

import pytest
import redis

from service.engine.kvtier.backend import BackendUnavailable
from service.engine.kvtier.redis_backend import RedisBackend
from tests.redis_process import RedisProcess

TAG = "00112233aabbccdd"


def key(i: int) -> str:
    return f"{TAG}/{i:016x}"


def backend(url: str, prefix: str, cap: int = 1 << 20, ttl: int = 60) -> RedisBackend:
    return RedisBackend(url, prefix=prefix, cap_bytes=cap, ttl_s=ttl, io_timeout_s=2.0)


def test_a_record_written_is_read_back_with_its_ttl(redis_url: str, redis_prefix: str) -> None:
    b = backend(redis_url, redis_prefix, ttl=60)
    try:
        b.put(key(1), b"x" * 100)
        assert b.get_many([key(1), key(2)]) == [b"x" * 100, None]
        client = redis.Redis.from_url(redis_url)
        assert 0 < client.ttl(redis_prefix + key(1)) <= 60  # type: ignore[operator]
        client.close()
        assert b.usage().entries == 1 and b.usage().bytes == 100
    finally:
        b.close()


def test_two_writers_share_one_cap_and_the_least_recently_used_go_first(
    redis_url: str, redis_prefix: str
) -> None:
    a, b = backend(redis_url, redis_prefix, cap=300), backend(redis_url, redis_prefix, cap=300)
    try:
        a.put(key(0), b"0" * 100)
        time.sleep(0.01)
        b.put(key(1), b"1" * 100)
        time.sleep(0.01)
        a.put(key(2), b"2" * 100)
        time.sleep(0.01)
        b.get_many([key(0)])  # 0 read last: 1 is the least recently used
        time.sleep(0.01)
        b.put(key(3), b"3" * 100)
        assert a.get_many([key(i) for i in range(4)]) == [b"0" * 100, None, b"2" * 100, b"3" * 100]
        assert b.usage().bytes == 300 and b.usage().entries == 3
        a.refresh_usage()
        assert a.usage().bytes == 300
    finally:
        a.close()
        b.close()


def test_rewriting_a_key_does_not_count_its_bytes_twice(redis_url: str, redis_prefix: str) -> None:
    b = backend(redis_url, redis_prefix)
    try:
        b.put(key(1), b"x" * 100)
        b.put(key(1), b"y" * 60)
        assert b.usage().bytes == 60 and b.usage().entries == 1
        b.delete(key(1))
        b.refresh_usage()
        assert b.usage().bytes == 0 and b.get_many([key(1)]) == [None]
    finally:
        b.close()


@pytest.mark.server
def test_a_stopped_server_raises_backend_unavailable(redis_server: RedisProcess) -> None:
    b = backend(f"unix://{redis_server.socket}", "kv:")
    try:
        b.put(key(1), b"x")
        redis_server.stop()
        started = time.monotonic()
        with pytest.raises(BackendUnavailable):
            b.get_many([key(1)])
        with pytest.raises(BackendUnavailable):
            b.put(key(2), b"x")
        assert time.monotonic() - started < 10  # fails, does not hang
    finally:
        b.close()
