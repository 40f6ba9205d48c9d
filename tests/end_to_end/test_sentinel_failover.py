"""`pagechat serve` on Redis Sentinel, with chats running while the master is SIGKILLed: the
service carries on on the promoted replica, no stored turn is lost, and every session resumes
whole. (tests/sessions/test_sentinel.py measures the store's own failover at the Redis level.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.chat_client import ChatClient, ChatServerError
from tests.api.server import ServerProcess, start_server, wait_balanced
from tests.sessions.test_sentinel import Cluster
from tests.tiny_model import make_tiny_llama

pytestmark = [pytest.mark.server, pytest.mark.timeout(180)]

CHATS = 4
TURNS_AFTER_KILL = 3
# Turns that were answering while no master could be reached may be refused as not stored
# (storage_unavailable: not fatal); the history then holds every turn that *was* stored.
REFUSABLE = {"storage_unavailable"}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    directory = tmp_path / "redis"
    directory.mkdir()
    cluster = Cluster(directory)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def server(tmp_path: Path, cluster: Cluster) -> Iterator[ServerProcess]:
    model = make_tiny_llama(tmp_path / "tiny")
    server = start_server(
        tmp_path / "server.log",
        *("--model", str(model), "--dtype", "float32", "--redis-url", cluster.url),
    )
    yield server
    code = server.stop()
    assert code == 0, server.log()


async def _chat(
    server: ServerProcess, killed: asyncio.Event, stored: dict[str, int], refused: list[str]
) -> tuple[str, str]:
    async with await ChatClient.connect(server.ws) as chat:
        opened = await chat.open("Be brief.")
        turns_after_kill = 0
        while turns_after_kill < TURNS_AFTER_KILL:
            was_killed = killed.is_set()
            try:
                await chat.ask(f"turn {stored.get(opened.session_id, 0)}", max_tokens=6)
            except ChatServerError as exc:
                assert exc.code in REFUSABLE and not exc.fatal, exc
                refused.append(exc.code)
                await asyncio.sleep(0.2)
                continue
            stored[opened.session_id] = stored.get(opened.session_id, 0) + 1
            turns_after_kill += was_killed
        return opened.session_id, opened.secret


async def test_chats_carry_on_through_a_sentinel_failover(
    cluster: Cluster, server: ServerProcess
) -> None:
    killed = asyncio.Event()
    stored: dict[str, int] = {}
    refused: list[str] = []
    chats = [asyncio.create_task(_chat(server, killed, stored, refused)) for _ in range(CHATS)]
    while sum(stored.values()) < 2 * CHATS:  # everyone is chatting
        await asyncio.sleep(0.05)
    old_master = cluster.master_address()
    killed_at = time.monotonic()
    await asyncio.to_thread(cluster.kill, cluster.master)
    killed.set()
    sessions = await asyncio.wait_for(asyncio.gather(*chats), 120)
    carried_on_after = time.monotonic() - killed_at
    assert cluster.master_address() != old_master  # the replica was promoted
    # Every session resumes with every turn that was stored, on the new master.
    for session_id, secret in sessions:
        async with await ChatClient.connect(server.ws) as chat:
            resumed = await chat.resume(session_id, secret)
        assert len(resumed.messages) == 2 * stored[session_id], (resumed.messages, stored)
    assert server.get("/health")[0] == 200
    await wait_balanced(server)
    print(f"chats carried on {carried_on_after:.1f}s after the kill; refused: {refused}")
