"""service/api/openai/sse.py: an event stream that stops generating the moment its client
goes, driven through its ASGI interface with an in-memory client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from service.api.openai.sse import EventStream, until_disconnected


class Client:
    """The ASGI side of one response: what was sent, and a disconnect to deliver on demand."""

    def __init__(self, fail_send_with: Exception | None = None) -> None:
        self.sent: list[dict[str, Any]] = []
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.fail_send_with = fail_send_with

    async def receive(self) -> dict[str, Any]:
        return await self.messages.get()

    async def send(self, message: dict[str, Any]) -> None:
        if self.fail_send_with is not None and message["type"] == "http.response.body":
            raise self.fail_send_with
        self.sent.append(message)

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


class Events:
    """An answer's events; `closed` once the stream is closed (the engine request aborted)."""

    def __init__(self, count: int | None) -> None:
        self.count = count  # None: without end, until closed
        self.closed = False
        self.yielded = 0
        self.more = asyncio.Event()

    async def __call__(self) -> AsyncIterator[bytes]:
        try:
            while self.count is None or self.yielded < self.count:
                self.yielded += 1
                yield f"data: {self.yielded}\n\n".encode()
                if self.count is None:
                    self.more.set()
                    await asyncio.sleep(0)
        finally:
            self.closed = True


async def serve(stream: EventStream, client: Client) -> None:
    await stream({"type": "http"}, client.receive, client.send)  # type: ignore[arg-type]


async def test_every_event_is_sent_then_the_end_of_the_body() -> None:
    events, closes, client = Events(3), [], Client()
    await serve(EventStream(events(), on_close=lambda: closes.append(1)), client)
    start = client.sent[0]
    assert (start["type"], start["status"]) == ("http.response.start", 200)
    headers = dict(start["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"cache-control"] == b"no-cache"
    assert client.bodies() == [b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n", b""]
    assert client.sent[-1]["more_body"] is False
    assert events.closed and closes == [1]


async def test_a_client_that_goes_stops_the_events_at_once() -> None:
    events, closes, client = Events(None), [], Client()
    served = asyncio.create_task(
        serve(EventStream(events(), on_close=lambda: closes.append(1)), client)
    )
    await events.more.wait()
    await client.messages.put({"type": "http.disconnect"})
    await served
    assert events.closed and closes == [1]
    assert client.bodies()[-1] != b""  # the body never ended: nobody was there to read it


async def test_a_send_that_fails_as_the_socket_does_is_no_error_of_ours() -> None:
    events, closes = Events(3), []
    await serve(EventStream(events(), on_close=lambda: closes.append(1)), Client(OSError()))
    assert events.closed and closes == [1]


async def test_any_other_failure_is_raised_after_closing() -> None:
    events, closes = Events(3), []
    with pytest.raises(RuntimeError, match="a bug"):
        stream = EventStream(events(), on_close=lambda: closes.append(1))
        await serve(stream, Client(RuntimeError("a bug")))
    assert events.closed and closes == [1]


async def test_until_disconnected_reads_past_other_messages() -> None:
    client = Client()
    for message in ({"type": "http.request", "body": b""}, {"type": "http.disconnect"}):
        await client.messages.put(message)
    await until_disconnected(client.receive)  # type: ignore[arg-type]
    assert client.messages.empty()
