"""An asyncio client of OpenAI's streamed /v1/chat/completions, timed per chunk, for benchmarks
that drive many streams from one process (benchmarks/peers.py).

HTTP/1.1 through h11 (uvicorn's own parser, so no new dependency) over asyncio streams: one
connection per request, `Connection: close`. h11 undoes the chunked transfer encoding both
servers use; `SSEParser` cuts the body into server-sent events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import h11


class StreamError(Exception):
    """The server refused the request, or ended the stream without `data: [DONE]`."""


class SSEParser:
    """Server-sent events from arbitrary pieces of a byte stream: `feed` returns the data of
    every event completed so far (its `data:` lines joined by newlines; comments, other
    fields and events without data are dropped), holding back a partial one."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, piece: bytes) -> list[str]:
        # An event ends at a blank line; the spec allows \r\n, \n or \r line ends.
        self._buffer += piece.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        out = []
        for event in events:
            data = [
                line[5:].removeprefix(b" ")
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            ]
            if data:
                out.append(b"\n".join(data).decode())
        return out


@dataclass(slots=True)
class StreamResult:
    """One streamed answer, timed on the client's clock (time.perf_counter)."""

    sent_at: float
    first_content_at: float | None = None  # the first chunk with text
    done_at: float | None = None  # data: [DONE]
    text: str = ""
    content_chunks: int = 0
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)  # the server's, from its last chunk

    @property
    def ttft_s(self) -> float:
        if self.first_content_at is None:
            raise StreamError("the stream carried no text")
        return self.first_content_at - self.sent_at

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens", -1))

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens", -1))

    def take(self, data: str, now: float) -> bool:
        """One event's data; True once it is the closing [DONE]."""
        if data == "[DONE]":
            self.done_at = now
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            raise StreamError(f"error event: {chunk['error']}")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            content = (choice.get("delta") or {}).get("content")
            if content:
                if self.first_content_at is None:
                    self.first_content_at = now
                self.content_chunks += 1
                self.text += content
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return False


async def stream_chat(
    host: str, port: int, body: dict[str, Any], timeout_s: float = 600.0
) -> StreamResult:
    """POST `body` (stream: true is set) to /v1/chat/completions; read it to [DONE]."""
    payload = json.dumps({**body, "stream": True}).encode()
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="POST",
        target="/v1/chat/completions",
        headers=[
            ("Host", f"{host}:{port}"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(payload))),
            ("Connection", "close"),
        ],
    )
    reader, writer = await asyncio.open_connection(host, port)
    try:
        result = StreamResult(sent_at=time.perf_counter())
        writer.write(conn.send(request) + conn.send(h11.Data(data=payload)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()
        async with asyncio.timeout(timeout_s):
            await _read_events(conn, reader, result)
        return result
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _read_events(
    conn: h11.Connection, reader: asyncio.StreamReader, result: StreamResult
) -> None:
    parser = SSEParser()
    status = 0
    error_body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            if status != 200:
                error_body += event.data
                continue
            now = time.perf_counter()
            for data in parser.feed(event.data):
                if result.take(data, now):
                    return
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            if status != 200:
                raise StreamError(f"HTTP {status}: {error_body.decode(errors='replace')[:500]}")
            raise StreamError("the stream ended before data: [DONE]")
