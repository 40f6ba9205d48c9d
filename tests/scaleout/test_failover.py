"""Two replicas behind nginx on loopback, sharing one Redis: a replica dies, nothing is lost.

The nginx config is the one docker-compose.yml mounts (deploy/nginx_conf.py), rendered for
loopback ports. A session chats on the replica its id hashes to (A); A is killed (SIGKILL, no
drain); the user reconnects through nginx with `?session=ID`, lands on B, sees its whole
history, and B loads the history's K/V from the third tier A wrote them to (the same Redis,
under the tier's own prefix: loaded tokens, not recomputed) and takes the session over; B's
next turn is a prefix-cache hit.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from clients.chat_client import Answer, ChatClient
from service.sessions.prompt import ChatFormat
from tests.api.server import (
    REDIS_URL,
    ServerProcess,
    delete_prefix,
    start_server,
    stored_session,
    unique_prefix,
    wait_balanced,
)
from tests.scaleout.nginx import NginxProcess, nginx_binary, start_nginx
from tests.tiny_model import gguf_tokenizer

pytestmark = [
    pytest.mark.server,
    pytest.mark.real_model,
    pytest.mark.timeout(300),
    pytest.mark.skipif(nginx_binary() is None, reason="nginx missing: apt-get install nginx"),
]

GREEDY = {"temperature": 0.0}
BLOCK_SIZE = 16
REPLICA_ARGS = ("--kv-cache-mb", "32", "--swap-space-mb", "32", "--max-model-len", "1024")


def owner(prefix: str, session_id: str) -> str:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        value = client.hget(f"{prefix}session:{session_id}", "owner")
        assert isinstance(value, str)
        return value
    finally:
        client.close()


async def wait_routed(nginx: NginxProcess, session_id: str, tried: list[str]) -> None:
    """Wait until nginx logs a request with `?session=ID` that tried exactly `tried`, in
    order (it logs a WebSocket when the tunnel closes, just after the client)."""
    pattern = rf'session="{re.escape(session_id)}" upstream=(.*?) time='
    for _ in range(100):
        logged = [[u.strip() for u in line.split(",")] for line in re.findall(pattern, nginx.log())]
        if tried in logged:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"nginx logged no request that tried {tried}:\n{nginx.log()}")


async def wait_tier_written(server: ServerProcess, prefix: str, session_id: str) -> None:
    """Until `server` has written every full block of the stored conversation to the tier
    (the tail completion runs after `done`; a replica killed before it finishes would leave
    the last turn's blocks to be recomputed)."""
    _, page_map = stored_session(prefix, session_id)
    assert page_map is not None
    full_blocks = len(page_map.token_ids) // page_map.block_size
    for _ in range(600):
        tier = (await server.astats())["kv_tier"]
        if tier["blocks_written"] >= full_blocks and not tier["pending_writes"]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the tier holds {tier} of {full_blocks} blocks")


async def turn(url: str, session_id: str, secret: str, content: str) -> tuple[int, int, Answer]:
    """Resume through `url` with `?session=ID`; (messages on resume, history tokens, answer)."""
    async with await ChatClient.connect(f"{url}?session={quote(session_id)}") as chat:
        resumed = await chat.resume(session_id, secret)
        answer = await chat.ask(content, max_tokens=8, **GREEDY)
    return len(resumed.messages), resumed.history_tokens, answer


async def test_a_session_survives_its_replica_and_its_kv_is_loaded_from_the_tier_on_another(
    tmp_path: Path,
) -> None:
    prefix = unique_prefix()
    common = (
        *("--redis-url", REDIS_URL, "--redis-prefix", prefix, *REPLICA_ARGS),
        *("--kv-tier-redis-url", REDIS_URL, "--kv-tier-redis-prefix", f"{prefix}kv:"),
    )
    started = await asyncio.gather(
        *(
            asyncio.to_thread(start_server, tmp_path / f"{name}.log", *common, "--replica-id", name)
            for name in ("replica-1", "replica-2")
        ),
        return_exceptions=True,
    )
    replicas = {s.log_path.stem: s for s in started if isinstance(s, ServerProcess)}
    nginx: NginxProcess | None = None
    try:
        for failure in started:
            if isinstance(failure, BaseException):
                raise failure
        nginx = await asyncio.to_thread(
            start_nginx,
            tmp_path / "nginx",
            [f"127.0.0.1:{s.port}" for s in replicas.values()],
        )
        # A unique system prompt: no replica holds any of this conversation's blocks.
        system = f"You are helpful. Conversation {uuid.uuid4().hex}."
        async with await ChatClient.connect(nginx.ws) as chat:
            opened = await chat.open(system=system)
            await chat.ask("Name a colour.", max_tokens=8, **GREEDY)
        session_id, secret = opened.session_id, opened.secret
        assert secret is not None

        # Back through nginx by session id: now on the replica the id hashes to, "A".
        # A long message: the blocks of this turn, which B never sees, are more than the
        # tier's MIN_LOAD_BLOCKS (kvtier/connector.py), so B asks the tier for them rather than
        # recomputing.
        fruit = "Name a fruit. " + " ".join(["Orchards grow many kinds of fruit."] * 14)
        _, first_history, _ = await turn(nginx.ws, session_id, secret, fruit)
        a_name = owner(prefix, session_id)
        [b_name] = set(replicas) - {a_name}
        a, b = replicas[a_name], replicas[b_name]
        await wait_tier_written(a, prefix, session_id)

        a.proc.kill()  # A dies: no drain, nothing written on its way out
        await asyncio.to_thread(a.proc.wait)

        messages, history, rebuilt = await turn(nginx.ws, session_id, secret, "Name a tree.")
        # nginx tried A (its connect refused), then served the connection from B.
        await wait_routed(nginx, session_id, [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"])
        assert messages == 4  # the whole conversation, from Redis
        assert owner(prefix, session_id) == b_name  # B took the session over
        u = rebuilt.usage
        user_turn = ChatFormat(gguf_tokenizer()).user_turn("Name a tree.")
        assert u.prompt_tokens == history + len(user_turn)
        assert u.cached_tokens + u.swapped_in_tokens + u.loaded_tokens + u.recomputed_tokens == (
            u.prompt_tokens
        )
        # B never saw the turn A answered: at most the session's first turn (B may have
        # opened it) can be cached there; the rest of the history is loaded from the tier,
        # and only its last partial block and the new message are computed.
        assert (
            u.loaded_tokens
            >= history // BLOCK_SIZE * BLOCK_SIZE - first_history // BLOCK_SIZE * BLOCK_SIZE
            > 0
        )
        assert (
            u.cached_tokens + u.swapped_in_tokens + u.loaded_tokens
            == history // BLOCK_SIZE * BLOCK_SIZE
        )
        assert u.recomputed_tokens < BLOCK_SIZE + len(user_turn)
        assert (await b.astats())["kv_tier"]["blocks_loaded"] * BLOCK_SIZE == u.loaded_tokens

        messages, history, cached = await turn(nginx.ws, session_id, secret, "Name a bird.")
        assert messages == 6 and owner(prefix, session_id) == b_name
        u = cached.usage
        assert u.cached_tokens >= history - BLOCK_SIZE  # the whole history, up to one block
        assert u.recomputed_tokens == u.prompt_tokens - u.cached_tokens - u.swapped_in_tokens
        await wait_balanced(b)
    finally:
        if nginx is not None:
            nginx.stop()
        codes = {name: s.stop() for name, s in replicas.items() if s.proc.poll() is None}
        delete_prefix(prefix)
    assert all(code == 0 for code in codes.values()), codes
