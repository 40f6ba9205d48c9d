"""One connection's outgoing frames: a bounded queue drained by a single writer task.

Why a queue: the answer's pump must never wait on a client's network. A client that reads
slowly lets frames pile up here, up to `max_frames`; one that stops reading stalls the writer
inside the transport. Either way, after `timeout_s` without progress the client is declared
gone: `send` raises ClientGone, the turn stores its answer as far as it got (it never depended
on the frames arriving), and `wait_gone` returns, so the connection ends itself.

NOTE: only the writer task touches the socket after the handshake (frames and the close), so
frames and the close go out in the order they were queued. Whatever the ASGI server raises on
a send (a closed socket, "websocket.send after websocket.close", a reset) means the client is
gone; it is never a bug of the turn that produced the frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from starlette.websockets import WebSocket

from protocol.frames import Codec, ServerFrame

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client's socket is closed, or too slow to be served: nothing more reaches it."""


@dataclass(slots=True, frozen=True)
class _Close:
    code: int


class FrameSender:
    def __init__(
        self,
        websocket: WebSocket,
        codec: Codec,
        *,
        max_frames: int,
        timeout_s: float,
    ) -> None:
        if max_frames < 1 or timeout_s <= 0:
            raise ValueError("max_frames must be >= 1 and timeout_s > 0")
        self._websocket = websocket
        self._codec = codec
        self._timeout_s = timeout_s
        self._queue: asyncio.Queue[ServerFrame | _Close] = asyncio.Queue(max_frames)
        self._gone = asyncio.Event()
        self.gone_reason: str | None = None
        self._writer = asyncio.create_task(self._write(), name="frame writer")

    @property
    def gone(self) -> bool:
        return self._gone.is_set()

    async def wait_gone(self) -> None:
        await self._gone.wait()

    async def send(self, frame: ServerFrame) -> None:
        """Queue one frame; ClientGone when the client is gone or has not read for too long."""
        await self._put(frame)

    async def close(self, code: int) -> None:
        """Send the queued frames, then close with `code`; ClientGone if that cannot be done."""
        await self._put(_Close(code))
        await self.flush()

    async def flush(self) -> None:
        """Wait until every queued frame is written (or the client is declared gone)."""
        join = asyncio.ensure_future(self._queue.join())
        gone = asyncio.ensure_future(self._gone.wait())
        try:
            await asyncio.wait({join, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            join.cancel()
            gone.cancel()
        if self.gone and not join.done():
            raise ClientGone(self.gone_reason)

    async def stop(self) -> None:
        """Stop the writer (frames still queued are dropped); the connection is ending."""
        self._writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._writer
        if not self.gone:
            self.gone_reason = "the connection ended"
            self._gone.set()
        self._drop_queued()

    # ------------------------------------------------------------------ internals

    async def _put(self, item: ServerFrame | _Close) -> None:
        if self.gone:
            raise ClientGone(self.gone_reason)
        try:
            self._queue.put_nowait(item)
            return
        except asyncio.QueueFull:
            pass
        # Full: wait for room, for the writer to give up, or for the deadline.
        put = asyncio.ensure_future(self._queue.put(item))
        gone = asyncio.ensure_future(self._gone.wait())
        try:
            await asyncio.wait({put, gone}, timeout=self._timeout_s, return_when="FIRST_COMPLETED")
        finally:
            gone.cancel()
            if not put.done():
                put.cancel()
        if not put.done() or put.cancelled():
            self._declare_gone(f"the client read nothing for {self._timeout_s:g}s")
            raise ClientGone(self.gone_reason)

    async def _write(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                if isinstance(item, _Close):
                    message = {"type": "websocket.close", "code": item.code, "reason": ""}
                else:
                    message = self._codec.encode(item)  # type: ignore[assignment]
                await asyncio.wait_for(self._websocket.send(message), self._timeout_s)
            except TimeoutError:
                self._declare_gone(f"a frame waited {self._timeout_s:g}s for the client to read")
            except Exception as exc:  # any send failure means the socket is done for
                self._declare_gone(f"the socket failed: {exc!r}")
            finally:
                self._queue.task_done()
            if self.gone:
                self._drop_queued()
                return
            if isinstance(item, _Close):
                self._gone.set()  # closed: nothing more may be sent, by design
                self.gone_reason = "the connection is closed"
                self._drop_queued()
                return

    def _drop_queued(self) -> None:
        while not self._queue.empty():
            self._queue.get_nowait()
            self._queue.task_done()

    def _declare_gone(self, reason: str) -> None:
        if self.gone:
            return
        self.gone_reason = reason
        self._gone.set()
        log.info("dropping a client: %s", reason)
