"""The third KV tier through `pagechat serve` (tiny model, the Redis on 6379 for sessions):
a restarted server loads a conversation's history from the tier instead of recomputing it,
shows the tier in /v1/stats, /metrics and /v1/kv, and a tier Redis stopped mid-turn costs
nothing but speed."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from clients.chat_client import ChatClient
from protocol.frames import Delta
from tests.api.server import (
    REDIS_URL,
    ServerProcess,
    delete_prefix,
    start_server,
    unique_prefix,
    wait_balanced,
)
from tests.redis_process import RedisProcess
from tests.tiny_model import make_tiny_llama

pytestmark = [pytest.mark.server, pytest.mark.timeout(180)]
GREEDY: dict[str, Any] = {"temperature": 0.0}
BLOCK = 16
LONG = " ".join(f"word{i}" for i in range(120))  # a history of many blocks


async def wait_written(server: ServerProcess, timeout: float = 30.0) -> dict[str, Any]:
    """Until the stored conversation's blocks are in the tier: nothing running or queued."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await server.astats()
        tier = stats["kv_tier"]
        if tier["blocks_written"] and not tier["pending_writes"] and stats["queue"]["running"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the tier was not written: {stats}"
        await asyncio.sleep(0.05)


async def test_a_restarted_server_loads_the_history_from_the_tier(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    prefix = unique_prefix()
    args = (
        *("--model", str(model), "--dtype", "float32", "--redis-url", REDIS_URL),
        *("--redis-prefix", prefix, "--kv-tier-directory", str(tmp_path / "tier")),
    )
    try:
        first = await asyncio.to_thread(start_server, tmp_path / "first.log", *args)
        try:
            async with await ChatClient.connect(first.ws) as chat:
                opened = await chat.open()
                await chat.ask(LONG, max_tokens=8, **GREEDY)
            await wait_written(first)
        finally:
            assert first.stop() == 0, first.log()
        assert opened.secret is not None

        second = await asyncio.to_thread(start_server, tmp_path / "second.log", *args)
        try:
            async with await ChatClient.connect(second.ws) as chat:
                resumed = await chat.resume(opened.session_id, opened.secret)
                answer = await chat.ask("And now?", max_tokens=4, **GREEDY)
            u = answer.usage
            history = resumed.history_tokens
            assert u.loaded_tokens >= history // BLOCK * BLOCK - BLOCK > 0
            assert (
                u.cached_tokens + u.swapped_in_tokens + u.loaded_tokens + u.recomputed_tokens
                == (u.prompt_tokens)
            )
            assert u.recomputed_tokens < 3 * BLOCK  # only the tail and the new message
            stats = await wait_balanced(second)
            tier = stats["kv_tier"]
            assert tier["blocks_loaded"] * BLOCK == u.loaded_tokens
            assert tier["backends"][0]["name"] == "dir" and tier["backends"][0]["entries"] > 0
            assert stats["prefix_cache"]["tier_hits"] == u.loaded_tokens
            loaded = await asyncio.to_thread(second.metric, "pagechat_kv_tier_blocks_loaded_total")
            assert loaded == tier["blocks_loaded"]
            status, body = await asyncio.to_thread(second.get, "/v1/kv")
            assert status == 200 and json.loads(body)["kv_tier"]["blocks_loaded"] > 0
        finally:
            assert second.stop() == 0, second.log()
    finally:
        delete_prefix(prefix)


async def test_a_tier_redis_stopped_mid_turn_never_fails_the_turn(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    tier_redis = RedisProcess(tmp_path)
    tier_redis.start()
    prefix = unique_prefix()
    server = await asyncio.to_thread(
        start_server,
        tmp_path / "server.log",
        *("--model", str(model), "--dtype", "float32", "--redis-url", REDIS_URL),
        *("--redis-prefix", prefix, "--kv-tier-redis-url", f"unix://{tier_redis.socket}"),
        # Small pools: blocks are dropped (and saved) while the answers run.
        *("--num-device-blocks", "80", "--num-cpu-blocks", "8"),
    )
    try:
        async with await ChatClient.connect(server.ws) as chat:
            await chat.open()
            await chat.ask(LONG, max_tokens=4, **GREEDY)
            await wait_written(server)
            sent = await chat.send_user("Tell me more.", max_tokens=48, ignore_eos=True, **GREEDY)
            assert isinstance(await chat.receive(), Delta)
            tier_redis.stop()  # mid-turn: saves of dropped blocks and the store's fail
            answer = await chat.collect(sent)
            assert answer.done is not None and answer.done.finish_reason in ("stop", "length")
            after = await chat.ask("Still there?", max_tokens=4, **GREEDY)
            assert after.done is not None
        # The outage is noticed by a failing save or by the writer's idle usage refresh,
        # whichever comes first (saves after that are counted as dropped): wait for it.
        deadline = time.monotonic() + 30.0
        while (tier := (await server.astats())["kv_tier"])["backends"][0]["available"]:
            assert time.monotonic() < deadline, tier
            await asyncio.sleep(0.05)
        await wait_balanced(server)
        status, _ = await asyncio.to_thread(server.get, "/health")
        assert status == 200  # the tier is not the service's health
    finally:
        code = server.stop()
        delete_prefix(prefix)
        if tier_redis.proc is not None and tier_redis.proc.poll() is None:
            tier_redis.stop()
    assert code == 0, server.log()
