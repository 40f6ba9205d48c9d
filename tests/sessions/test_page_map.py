"""PageMap (service/sessions/models.py) as Redis holds it: page maps written before the record
lost its per-block fields (`block_hashes`, `tiers`, `replica`) still load, what is written
now is the ids and what they were computed under, nothing else, and a record this version
cannot read costs a recompute, not the session."""

from __future__ import annotations

import msgspec
import pytest
import redis

from service.sessions.models import PageMap
from service.sessions.redis_server import connect
from service.sessions.store import SessionStore
from tests.api.server import REDIS_URL, delete_prefix, unique_prefix

# A page map as the earlier code wrote it (msgpack, as under session:{id}:pagemap): ids
# [1, 2, 3, 4, 5, 300, 70000], block size 4, one 64-bit block hash, tier "none", namespace
# "model|", model "model", replica "replica-a", updated 1700000000.5.
OLD_RECORD = bytes.fromhex(
    "88a9746f6b656e5f696473970102030405cd012cce00011170aa626c6f636b5f73697a6504ac626c6f636b5f"
    "68617368657391cf8000000000000000a5746965727391a46e6f6e65a96e616d657370616365a66d6f6465"
    "6c7ca86d6f64656c5f6964a56d6f64656ca77265706c696361a97265706c6963612d61a775706461746564cb"
    "41d954fc40200000"
)


def test_a_page_map_written_with_block_hashes_tiers_and_replica_still_loads() -> None:
    decoded = msgspec.msgpack.Decoder(PageMap).decode(OLD_RECORD)  # as the store decodes
    assert decoded == PageMap(
        token_ids=[1, 2, 3, 4, 5, 300, 70000],
        block_size=4,
        namespace="model|",
        model_id="model",
        updated=1700000000.5,
    )


def test_a_page_map_is_written_without_per_block_fields() -> None:
    page_map = PageMap(token_ids=[7, 8, 9], block_size=4, namespace="m|", model_id="m", updated=2.0)
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(page_map))
    assert set(fields) == {"token_ids", "block_size", "namespace", "model_id", "updated"}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(page_map), type=PageMap) == page_map


async def test_a_page_map_this_version_cannot_read_loads_as_none_and_the_session_survives(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another version's record (a rolling update): the turn falls back to the stored text,
    as for another model's page map, instead of failing."""
    prefix = unique_prefix()
    store = SessionStore(connect(REDIS_URL), prefix=prefix, ttl_s=600, replica="r")
    try:
        created = await store.create(model_id="m", system=None)
        sid = created.meta.session_id
        foreign = msgspec.msgpack.encode({"tokens": [1, 2], "format": 9})
        with redis.Redis.from_url(REDIS_URL) as raw:
            raw.set(store.page_map_key(sid), foreign)
        meta, page_map = await store.load(sid)
        assert meta.session_id == sid and page_map is None
        assert "unreadable" in caplog.text
    finally:
        await store.close()
        delete_prefix(prefix)
