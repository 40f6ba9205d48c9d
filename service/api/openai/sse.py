"""A text/event-stream response that stops generating the moment its client goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class EventStream(Response):
    """A text/event-stream that stops generating the moment its client goes away.

    Starlette's StreamingResponse leaves its iterator suspended when the client disconnects
    (closed only when collected), which would keep the engine request running. Here the
    pump is cancelled on `http.disconnect`, and the iterator is closed in every case, which
    aborts the engine request before its next step.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            async with contextlib.aclosing(self.events) as events:  # type: ignore[type-var]
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                )
                async for data in events:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            await until_disconnected(receive)
            streaming.cancel()

        streaming = asyncio.create_task(pump())
        watcher = asyncio.create_task(watch())
        try:
            await asyncio.wait([streaming])
        finally:
            watcher.cancel()
            if not streaming.done():  # we were cancelled ourselves
                streaming.cancel()
            self.on_close()
        if not streaming.cancelled() and streaming.exception() is not None:
            exc = streaming.exception()
            if not isinstance(exc, OSError):  # a client gone mid-send is no error of ours
                raise exc  # type: ignore[misc]


async def until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
