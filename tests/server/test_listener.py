"""The listening socket's gate (service/server/listener.py) in front of the guarded h11 protocol
(service/server/http_guard.py), in process on loopback: uvicorn's protocol on asyncio's accept
loop, a two-line ASGI app, and clients from 127.0.0.2 and 127.0.0.1 (all of 127.0.0.0/8 is
loopback on Linux)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from service.server.connection_log import ConnectionLog
from service.server.http_guard import Waiting, guarded_h11
from service.server.listener import AcceptPolicy, OpenFiles, bind

HALF_HANDSHAKE = b"GET /v1/chat HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
CAP = 4
FLOODER = "127.0.0.2"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@dataclass
class Gate:
    port: int
    policy: AcceptPolicy
    waiting: Waiting


@pytest.fixture
async def gate(request: pytest.FixtureRequest) -> AsyncIterator[Gate]:
    """A server on 127.0.0.1 whose policy caps each address at CAP waiting connections
    (`trusted`: the addresses exempt), with descriptors plenty unless a test lowers them."""
    trusted = getattr(request, "param", ())
    waiting = Waiting()
    closed_log = ConnectionLog(logging.getLogger("test.closed"), every_s=3600.0)
    policy = AcceptPolicy(
        waiting,
        closed_log,
        OpenFiles(reserve=0, limit=1 << 30, recount_s=0.0),
        max_pending_per_address=CAP,
        trusted_proxies=tuple(ipaddress.ip_network(t) for t in trusted),
        capped_from=0.0,  # capped at once: its descriptors are plenty
    )
    config = uvicorn.Config(app, lifespan="off", log_config=None)
    config.load()
    state = ServerState()
    protocol = guarded_h11(10.0, 1000, waiting, closed_log)
    (listener,) = bind("127.0.0.1", 0, policy)
    server = await asyncio.get_running_loop().create_server(
        lambda: protocol(config=config, server_state=state, app_state={}), sock=listener
    )
    try:
        yield Gate(listener.getsockname()[1], policy, waiting)
    finally:
        server.close()
        for connection in list(state.connections):
            connection.shutdown()
        await server.wait_closed()
        closed_log.close()


async def half_open(
    port: int, source: str = FLOODER
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(HALF_HANDSHAKE)
    await writer.drain()
    return reader, writer


async def ended_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server ended the connection without a reply (a reset, or end of stream);
    waits for it."""
    try:
        return await asyncio.wait_for(reader.read(), 30) == b""
    except ConnectionResetError:
        return True


async def get(port: int, source: str = "127.0.0.1") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    reply = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    return reply


async def turned_away(port: int, source: str = FLOODER) -> bool:
    """Whether a new connection from `source` is ended by the server without a reply (reset
    as it connects, or later)."""
    try:
        reader, writer = await half_open(port, source)
    except ConnectionResetError:
        return True
    try:
        return await ended_by_server(reader)
    finally:
        writer.close()


def still_open(reader: asyncio.StreamReader) -> bool:
    return not reader.at_eof() and reader.exception() is None


def counted(caplog: pytest.LogCaptureFixture, what: str) -> int:
    """How many connections the closed-connection lines say were closed `what`."""
    pattern = re.compile(r"([\d,]+) " + re.escape(what))
    return sum(
        int(match.group(1).replace(",", ""))
        for record in caplog.records
        for match in pattern.finditer(record.getMessage())
    )


async def test_an_address_past_its_cap_is_reset_as_accepted_while_others_get_in(
    gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="test.closed")
    held = [await half_open(gate.port) for _ in range(CAP)]
    for _ in range(3):
        assert await turned_away(gate.port)
    # Accepted in order: the held ones were judged before the extra ones, and kept.
    assert all(still_open(reader) for reader, _ in held)
    assert gate.waiting.of(FLOODER) == CAP
    assert (await get(gate.port)).startswith(b"HTTP/1.1 200 ")
    for _, writer in held:
        writer.close()
    gate.policy.closed_log.close()
    assert counted(caplog, "reset as accepted (the address had 4 connections waiting") == 3


async def test_past_its_cap_a_request_whose_headers_are_in_as_it_is_accepted_is_answered(
    gate: Gate,
) -> None:
    held = [await half_open(gate.port) for _ in range(CAP)]
    # Connected and sent while the loop waits (blocking calls): all in before accept().
    sock = socket.create_connection(("127.0.0.1", gate.port), source_address=(FLOODER, 0))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    reader, writer = await asyncio.open_connection(sock=sock)
    assert (await asyncio.wait_for(reader.read(), 30)).startswith(b"HTTP/1.1 200 ")
    writer.close()
    assert await turned_away(gate.port)  # half a request is not
    assert all(still_open(r) for r, _ in held)
    for _, w in held:
        w.close()


async def test_a_finished_request_frees_its_place_under_the_cap(gate: Gate) -> None:
    held = [await half_open(gate.port) for _ in range(CAP)]
    first_reader, first_writer = held[0]
    first_writer.write(b"Connection: close\r\n\r\n")  # its headers end
    assert (await asyncio.wait_for(first_reader.read(), 30)).startswith(b"HTTP/1.1 200 ")
    reader, writer = await half_open(gate.port)  # in its place
    assert (await get(gate.port)).startswith(b"HTTP/1.1 200 ")  # accepted after it
    assert still_open(reader) and gate.waiting.of(FLOODER) == CAP
    assert await turned_away(gate.port)
    for _, w in [*held, (reader, writer)]:
        w.close()


@pytest.mark.parametrize("gate", [("127.0.0.2/32",)], indirect=True)
async def test_a_trusted_proxy_is_not_capped(gate: Gate) -> None:
    held = [await half_open(gate.port) for _ in range(3 * CAP)]
    assert (await get(gate.port)).startswith(b"HTTP/1.1 200 ")  # after them all, in order
    assert all(still_open(reader) for reader, _ in held)
    assert gate.waiting.of(FLOODER) == 3 * CAP
    for _, writer in held:
        writer.close()


async def test_with_descriptors_low_a_new_connection_pushes_out_the_longest_waiting(
    gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="test.closed")
    oldest, newer = await half_open(gate.port), await half_open(gate.port, "127.0.0.3")
    assert (await get(gate.port)).startswith(b"HTTP/1.1 200 ")  # both accepted by now
    gate.policy.files.limit = 0  # from here on every descriptor is in the reserve
    assert (await get(gate.port, "127.0.0.4")).startswith(b"HTTP/1.1 200 ")
    assert await ended_by_server(oldest[0])
    assert still_open(newer[0])
    for _, writer in (oldest, newer):
        writer.close()
    gate.policy.closed_log.close()
    assert counted(caplog, "pushed out for a newer one") == 1


async def test_with_descriptors_low_and_none_waiting_a_new_connection_is_reset(
    gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="test.closed")
    gate.policy.files.limit = 0
    assert await turned_away(gate.port, "127.0.0.4")
    gate.policy.closed_log.close()
    assert counted(caplog, "reset as accepted (file descriptors low") == 1


def test_open_files_counts_kept_connections_till_they_close_and_the_rest_by_listing() -> None:
    files = OpenFiles(reserve=3, limit=1 << 20, recount_s=3600.0)
    a, b = socket.socketpair()
    with a, b:

        def accepted() -> int:  # a new descriptor, as accept() would give
            return os.dup(a.fileno())

        first = accepted()
        assert not files.low(first)  # the first call lists what is open: all but `first`
        held = len(os.listdir("/proc/self/fd")) - 1
        files.limit = held + 1 + files.reserve  # room for one more before the reserve
        kept = files.kept(first, a.family, a.type, a.proto)
        second = accepted()
        assert not files.low(second)
        kept_too = files.kept(second, a.family, a.type, a.proto)
        assert files.connections == 2
        third = accepted()
        assert files.low(third)
        os.close(third)
        kept.close()
        kept.close()  # counted out once
        assert files.connections == 1
        third = accepted()
        assert not files.low(third)
        os.close(third)
        kept_too.close()
        assert files.connections == 0
    # accept() returns the lowest free descriptor: one at the floor says so by itself.
    assert files.low(files.limit - files.reserve)


def test_the_cap_waits_till_half_the_descriptors_are_in_use() -> None:
    # a burst of clients from one address (a load test, a NAT) that the process has the
    # descriptors for is not reset at its cap; the same burst with half of them in use is
    waiting = Waiting()
    files = OpenFiles(reserve=0, limit=1 << 20, recount_s=0.0)
    closed_log = ConnectionLog(logging.getLogger("test.closed"), every_s=3600.0)
    policy = AcceptPolicy(waiting, closed_log, files, max_pending_per_address=2)
    a, b = socket.socketpair()  # b: the connection just accepted, its headers not in
    with a, b:
        for fd in (101, 102):  # two already waiting for their headers
            waiting.accepted(fd, "10.0.0.9")
        assert policy.judge(b.fileno(), "10.0.0.9", low=False) is None
        waiting.ended(b.fileno())
        files.limit = 2 * files.held(b.fileno())
        reason = policy.judge(b.fileno(), "10.0.0.9", low=False)
        assert reason is not None and "connections waiting for their headers" in reason
    closed_log.close()
