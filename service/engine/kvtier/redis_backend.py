"""A Redis backend: one string per block under the tier's prefix, with a TTL and a byte cap.

Keys (all under `prefix`, default `pagechat:kv:`):
  {prefix}{tag}/{hash}   string: the record; expires `ttl_s` after its latest write or read
  {prefix}lru            sorted set: block key -> unix time of its latest write or read
  {prefix}sizes          hash: block key -> record bytes
  {prefix}bytes          string: the sum of `sizes`

NOTE (cap and LRU): a write runs one Lua script that stores the record, records its size and
time, forgets entries whose TTL has run out, and deletes the least recently used entries
until the total is under the cap. Every replica writing to the same prefix shares one cap.
The three bookkeeping keys expire with the entries, so an abandoned tier leaves nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

import redis
import redis.exceptions

from service.engine.kvtier.backend import BackendUnavailable, BackendUsage

# KEYS: block, lru, sizes, bytes. ARGV: record, ttl s, now, cap bytes.
# -> {evicted, total bytes, entries}
_PUT = """
local old = redis.call('HGET', KEYS[3], KEYS[1])
if old then redis.call('DECRBY', KEYS[4], old) end
local size = string.len(ARGV[1])
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('HSET', KEYS[3], KEYS[1], size)
redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
local total = redis.call('INCRBY', KEYS[4], size)
local function forget(key)
  redis.call('ZREM', KEYS[2], key)
  local n = redis.call('HGET', KEYS[3], key)
  redis.call('HDEL', KEYS[3], key)
  redis.call('DEL', key)
  if n then total = redis.call('DECRBY', KEYS[4], n) end
end
for _, key in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[3] - ARGV[2])) do
  forget(key)
end
local evicted = 0
while total > tonumber(ARGV[4]) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then break end
  forget(oldest[1])
  evicted = evicted + 1
end
for i = 2, 4 do redis.call('EXPIRE', KEYS[i], ARGV[2]) end
return {evicted, total, redis.call('ZCARD', KEYS[2])}
"""


class RedisBackend:
    name = "redis"

    def __init__(
        self, url: str, *, prefix: str, cap_bytes: int, ttl_s: int, io_timeout_s: float
    ) -> None:
        self.prefix = prefix
        self.cap_bytes = cap_bytes
        self.ttl_s = ttl_s
        try:
            self._redis = redis.Redis.from_url(
                url,
                socket_timeout=io_timeout_s,
                socket_connect_timeout=io_timeout_s,
                retry_on_timeout=False,
            )
        except ValueError as exc:
            raise ValueError(f"kv tier Redis URL {url!r}: {exc}") from None
        self._put = self._redis.register_script(_PUT)
        self._lru, self._sizes, self._bytes_key = (
            f"{prefix}{k}" for k in ("lru", "sizes", "bytes")
        )
        self._usage = BackendUsage(0, 0, cap_bytes)

    def put(self, key: str, record: bytes) -> None:
        if len(record) > self.cap_bytes:
            return
        keys = [self.prefix + key, self._lru, self._sizes, self._bytes_key]
        try:
            _, total, entries = cast(
                list[int],
                self._put(keys=keys, args=[record, self.ttl_s, time.time(), self.cap_bytes]),
            )
        except redis.exceptions.RedisError as exc:
            raise BackendUnavailable(f"redis put: {exc}") from None
        self._usage = BackendUsage(int(entries), int(total), self.cap_bytes)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        names = [self.prefix + key for key in keys]
        try:
            found = cast(list[Any], self._redis.mget(names))
            hits = [name for name, value in zip(names, found, strict=True) if value is not None]
            if hits:
                now = time.time()
                with self._redis.pipeline(transaction=False) as pipe:
                    for name in hits:
                        pipe.expire(name, self.ttl_s)
                        pipe.zadd(self._lru, {name: now}, xx=True)
                    pipe.execute()
        except redis.exceptions.RedisError as exc:
            raise BackendUnavailable(f"redis get: {exc}") from None
        return [None if value is None else bytes(value) for value in found]

    def delete(self, key: str) -> None:
        name = self.prefix + key
        try:
            size = self._redis.hget(self._sizes, name)
            with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(name)
                pipe.zrem(self._lru, name)
                pipe.hdel(self._sizes, name)
                if size is not None:
                    pipe.decrby(self._bytes_key, int(cast(bytes, size)))
                pipe.execute()
        except redis.exceptions.RedisError as exc:
            raise BackendUnavailable(f"redis delete: {exc}") from None

    def usage(self) -> BackendUsage:
        return self._usage

    def refresh_usage(self) -> None:
        """Read the shared totals (every replica's writes), for `usage`."""
        try:
            total = self._redis.get(self._bytes_key)
            entries = self._redis.zcard(self._lru)
        except redis.exceptions.RedisError as exc:
            raise BackendUnavailable(f"redis usage: {exc}") from None
        self._usage = BackendUsage(entries, int(cast(bytes | None, total) or 0), self.cap_bytes)

    def close(self) -> None:
        self._redis.close()
