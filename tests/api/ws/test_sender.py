"""service/api/ws/sender.py: one connection's outgoing frames, in order, through one writer;
a client that cannot be served is declared gone, never waited on for ever. Driven with an
in-memory socket."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from protocol.frames import Codec, Delta
from service.api.ws.sender import ClientGone, FrameSender


class Socket:
    """Records what is sent; `stalled` holds every send (a client whose buffers are full);
    `fails` makes every send raise (a closed socket)."""

    def __init__(self, *, stalled: bool = False, fails: bool = False) -> None:
        self.sent: list[dict[str, Any]] = []
        self.stalled = stalled
        self.fails = fails

    async def send(self, message: dict[str, Any]) -> None:
        if self.fails:
            raise RuntimeError("websocket.send after websocket.close")
        if self.stalled:
            await asyncio.Event().wait()
        self.sent.append(message)

    def texts(self) -> list[str]:
        return [json.loads(m["text"])["text"] for m in self.sent if "text" in m]


def sender(socket: Socket, max_frames: int = 8, timeout_s: float = 60.0) -> FrameSender:
    return FrameSender(socket, Codec(binary=False), max_frames=max_frames, timeout_s=timeout_s)  # type: ignore[arg-type]


def delta(text: str) -> Delta:
    return Delta(text=text, token_ids=[])


async def test_frames_go_out_in_order_then_the_close() -> None:
    socket = Socket()
    frames = sender(socket)
    for text in "abc":
        await frames.send(delta(text))
    await frames.close(1000)
    assert socket.texts() == ["a", "b", "c"]
    assert socket.sent[-1] == {"type": "websocket.close", "code": 1000, "reason": ""}
    assert frames.gone  # closed: nothing more may be sent
    with pytest.raises(ClientGone):
        await frames.send(delta("d"))
    await frames.stop()


async def test_a_failed_send_means_the_client_is_gone() -> None:
    frames = sender(Socket(fails=True))
    await frames.send(delta("a"))
    await frames.wait_gone()
    assert frames.gone_reason is not None and "socket failed" in frames.gone_reason
    with pytest.raises(ClientGone):
        await frames.send(delta("b"))
    await frames.stop()


async def test_a_writer_stalled_past_the_timeout_drops_the_client() -> None:
    frames = sender(Socket(stalled=True), timeout_s=0.01)
    await frames.send(delta("a"))
    await frames.wait_gone()
    assert frames.gone_reason is not None and "waited" in frames.gone_reason
    with pytest.raises(ClientGone):
        await frames.send(delta("b"))
    await frames.stop()


async def test_a_full_queue_that_never_drains_drops_the_client() -> None:
    frames = sender(Socket(stalled=True), max_frames=1, timeout_s=0.01)
    with pytest.raises(ClientGone):
        for text in "abcdef":  # one is taken by the stalled writer, one fills the queue
            await frames.send(delta(text))
    assert frames.gone


async def test_stop_drops_what_is_queued_and_ends_the_connection() -> None:
    socket = Socket(stalled=True)
    frames = sender(socket, timeout_s=60)
    for text in "abc":
        await frames.send(delta(text))
    await frames.stop()
    assert frames.gone and frames.gone_reason == "the connection ended"
    await frames.flush()  # nothing left queued: returns at once
    assert socket.sent == []


async def test_limits_must_be_positive() -> None:
    for max_frames, timeout_s in ((0, 1.0), (1, 0.0)):
        with pytest.raises(ValueError):
            sender(Socket(), max_frames, timeout_s)
