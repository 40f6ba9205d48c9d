"""An asyncio client for pagechat's /v1/chat WebSocket protocol (docs/protocol.md).

async with await ChatClient.connect("ws://127.0.0.1:8000/v1/chat") as chat:
    opened = await chat.open(system="You are terse.")
    answer = await chat.ask("Hello!", max_tokens=64, temperature=0.0)
    print(answer.text, answer.usage)
async with await ChatClient.connect("ws://127.0.0.1:8000/v1/chat") as chat:  # later
    await chat.resume(opened.session_id, opened.secret)
"""

from __future__ import annotations

import time
import urllib.parse
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.typing import Subprotocol

from protocol.frames import (
    MSGPACK_SUBPROTOCOL,
    Cancel,
    ClientFrame,
    Delta,
    Done,
    Error,
    Open,
    Resume,
    ServerFrame,
    SessionOpened,
    Timing,
    Usage,
    User,
    UserParams,
)


class ChatServerError(Exception):
    """The server answered with an error frame."""

    def __init__(self, frame: Error) -> None:
        super().__init__(f"{frame.code}: {frame.message}")
        self.code = str(frame.code)
        self.message = frame.message
        self.fatal = frame.fatal
        self.frame = frame  # every field, e.g. `limit` on message_too_long


@dataclass
class Answer:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    sent_at: float = 0.0  # time.monotonic() when the user frame was sent
    delta_times: list[float] = field(default_factory=list)  # arrival of each delta frame
    done: Done | None = None

    @property
    def usage(self) -> Usage:
        assert self.done is not None
        return self.done.usage

    @property
    def timing(self) -> Timing:
        assert self.done is not None
        return self.done.timing

    @property
    def finish_reason(self) -> str:
        assert self.done is not None
        return str(self.done.finish_reason)

    @property
    def margins(self) -> list[float]:
        """Per token, the top-1 minus top-2 log-probability (needs logprobs >= 2)."""
        return [pairs[1][1] - pairs[2][1] for pairs in self.logprobs]


class ChatClient:
    def __init__(self, websocket: ClientConnection, *, binary: bool) -> None:
        self.websocket = websocket
        self.binary = binary
        self._json_out = msgspec.json.Encoder()
        self._msgpack_out = msgspec.msgpack.Encoder()
        self._json_in = msgspec.json.Decoder(ServerFrame)
        self._msgpack_in = msgspec.msgpack.Decoder(ServerFrame)
        self.session_id: str | None = None
        self.secret: str | None = None

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        binary: bool = False,
        max_size: int | None = 4 << 20,
        session_id: str | None = None,
        **kwargs: Any,
    ) -> ChatClient:
        """Open a socket. Pass `session_id` when resuming: it goes into the URL
        (`?session=ID`) so a proxy in front of several replicas routes the socket to the
        replica holding the session's pages (docs/deploy.md)."""
        if session_id is not None:
            url += ("&" if "?" in url else "?") + urllib.parse.urlencode({"session": session_id})
        subprotocols = [Subprotocol(MSGPACK_SUBPROTOCOL)] if binary else None
        websocket = await connect(
            url, subprotocols=subprotocols, max_size=max_size, proxy=None, **kwargs
        )
        return cls(websocket, binary=binary)

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.websocket.close()

    # ------------------------------------------------------------------ frames

    async def send(self, frame: ClientFrame) -> None:
        if self.binary:
            await self.websocket.send(self._msgpack_out.encode(frame))
        else:
            await self.websocket.send(self._json_out.encode(frame).decode())

    async def send_raw(self, data: str | bytes) -> None:
        await self.websocket.send(data)

    async def receive(self) -> ServerFrame:
        data = await self.websocket.recv()
        if isinstance(data, bytes):
            return self._msgpack_in.decode(data)
        return self._json_in.decode(data)

    async def expect(self, kind: type[Any]) -> Any:
        """The next frame, which must be `kind`; an error frame raises ChatServerError."""
        frame = await self.receive()
        if isinstance(frame, Error) and kind is not Error:
            raise ChatServerError(frame)
        if not isinstance(frame, kind):
            raise AssertionError(f"expected {kind.__name__}, got {frame!r}")
        return frame

    # ------------------------------------------------------------------ sessions

    async def open(self, system: str | None = None, *, api_key: str | None = None) -> SessionOpened:
        """`api_key`: for a server with API keys, unless the socket sent `Authorization`."""
        await self.send(Open(system=system, api_key=api_key))
        opened: SessionOpened = await self.expect(SessionOpened)
        self.session_id, self.secret = opened.session_id, opened.secret
        return opened

    async def resume(
        self, session_id: str, secret: str, *, api_key: str | None = None
    ) -> SessionOpened:
        await self.send(Resume(session_id=session_id, secret=secret, api_key=api_key))
        opened: SessionOpened = await self.expect(SessionOpened)
        self.session_id, self.secret = session_id, secret
        return opened

    async def send_user(self, content: str, **params: Any) -> float:
        """Send a user message; return when it was sent (time.monotonic())."""
        await self.send(User(content=content, params=UserParams(**params)))
        return time.monotonic()

    async def cancel(self) -> None:
        await self.send(Cancel())

    async def collect(self, sent_at: float = 0.0) -> Answer:
        """Read deltas until the done frame; an error frame raises ChatServerError."""
        answer = Answer(sent_at=sent_at)
        while True:
            frame = await self.receive()
            if isinstance(frame, Delta):
                answer.delta_times.append(time.monotonic())
                answer.text += frame.text
                answer.token_ids += frame.token_ids
                answer.logprobs += frame.logprobs or []
            elif isinstance(frame, Done):
                answer.done = frame
                return answer
            elif isinstance(frame, Error):
                raise ChatServerError(frame)
            else:
                raise AssertionError(f"unexpected frame while answering: {frame!r}")

    async def ask(self, content: str, **params: Any) -> Answer:
        return await self.collect(await self.send_user(content, **params))
