"""A blocking /v1/chat client for Locust users (gevent makes its socket cooperative).

The frames are the server's own msgspec Structs (protocol.frames); the asyncio client in
clients/chat_client.py speaks the same protocol for code that runs on an event loop.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit, urlunsplit

import msgspec
import websocket

from clients.chat_client import ChatServerError as ServerError
from protocol.frames import (
    ClientFrame,
    Delta,
    Done,
    Error,
    Open,
    Resume,
    ServerFrame,
    SessionOpened,
    User,
    UserParams,
)


@dataclass(slots=True)
class TurnResult:
    """One answer as the client saw it; times are time.perf_counter() seconds."""

    sent_at: float
    token_times: list[float] = field(default_factory=list)  # one entry per token received
    text: str = ""
    done: Done | None = None

    def add_tokens(self, count: int, now: float) -> None:
        """A delta of `count` tokens arrived at `now`; tokens sharing a frame get evenly
        spaced times since the previous one (the first frame's all count as first)."""
        times = self.token_times
        if not times:
            times += [now] * count
            return
        last = times[-1]
        times += [last + (now - last) * (i + 1) / count for i in range(count)]

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times else None

    @property
    def inter_token_s(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


def chat_url(base: str, session_id: str | None = None) -> str:
    """`ws://host:port/v1/chat` from a Locust host (http(s):// or ws(s)://, with or without
    the path); a resuming client adds `?session=ID`, which the proxy routes on."""
    parts = urlsplit(base)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path.rstrip("/")
    if not path.endswith("/v1/chat"):
        path += "/v1/chat"
    query = "" if session_id is None else f"session={quote(session_id, safe='')}"
    return urlunsplit((scheme, parts.netloc, path, query, ""))


class ChatSocket:
    """One WebSocket connection holding at most one session."""

    def __init__(self, url: str, *, timeout_s: float) -> None:
        # No proxy from the environment: load tests measure the server, not a proxy.
        self._ws = websocket.create_connection(url, timeout=timeout_s, http_no_proxy=["*"])
        self._encode = msgspec.json.Encoder().encode
        self._decode = msgspec.json.Decoder(ServerFrame).decode
        self.session_id: str | None = None
        self.secret: str | None = None

    def close(self) -> None:
        self._ws.close()

    def send(self, frame: ClientFrame) -> None:
        self._ws.send(self._encode(frame).decode())

    def receive(self) -> ServerFrame:
        data = self._ws.recv()
        return self._decode(data)

    def _session(self) -> SessionOpened:
        frame = self.receive()
        if isinstance(frame, Error):
            raise ServerError(frame)
        if not isinstance(frame, SessionOpened):
            raise AssertionError(f"expected a session frame, got {frame!r}")
        self.session_id = frame.session_id
        return frame

    def open(self, system: str | None = None) -> SessionOpened:
        self.send(Open(system=system))
        opened = self._session()
        self.secret = opened.secret
        return opened

    def resume(self, session_id: str, secret: str) -> SessionOpened:
        self.send(Resume(session_id=session_id, secret=secret))
        opened = self._session()
        self.secret = secret
        return opened

    def ask(self, content: str, params: UserParams, *, read_delay_s: float = 0.0) -> TurnResult:
        """Send a user message and read its deltas up to the done frame (`read_delay_s`
        between frames: a slow reader, whose unread frames wait in the server's queue)."""
        result = TurnResult(sent_at=time.perf_counter())
        self.send(User(content=content, params=params))
        while True:
            if read_delay_s:
                time.sleep(read_delay_s)
            frame = self.receive()
            if isinstance(frame, Delta):
                result.add_tokens(len(frame.token_ids), time.perf_counter())
                result.text += frame.text
            elif isinstance(frame, Done):
                result.done = frame
                return result
            elif isinstance(frame, Error):
                raise ServerError(frame)
            else:
                raise AssertionError(f"unexpected frame while answering: {frame!r}")
