"""A reconnect flood against a real server at its open-file limit (issue 39): the server under
`prlimit --nofile=512`, sockets that each hold half a WebSocket handshake and are reopened as
soon as the server ends them (benchmarks/reconnect_flood.py), from one client address past
its cap, then from twelve whose caps together pass the descriptors, then with no descriptors
kept back at all. Meanwhile, from 127.0.0.1, /health answers every time, a whole WebSocket chat
turn and a chat completion are answered, accept() never meets an EMFILE it leaves to asyncio,
and the log stays a handful of lines.

The issue's figures (2,048 descriptors, 2,100 sockets) scaled by a quarter: 512 and 525."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.reconnect_flood import (
    FloodCounts,
    closed_counts,
    flood_result,
    open_files,
    probe_health,
    start_flood,
)
from clients.chat_client import ChatClient
from service.server.http_guard import PUSHED_OUT
from tests.api.server import ServerProcess, running_server, wait_balanced

pytestmark = [
    pytest.mark.server,
    pytest.mark.real_model,
    pytest.mark.timeout(600),
]

NOFILE = 512
SOCKETS = 525  # 2,100 * 512 / 2,048
ONE_CLIENT = ["127.0.0.2"]
# Twelve clients under their cap of 64 each, 768 together: past the 512 - 128 descriptors
# left once the reserve (--fd-reserve 128) is kept back.
TWELVE_CLIENTS = [f"127.0.0.{n}" for n in range(2, 14)]
RESET_OVER_CAP = "reset as accepted (the address had 64 connections waiting for their headers)"
HEALTH_PROBES = 5
LOG_LINES_DURING = 100  # the flood's own share of the log: a line per 10 s per kind, at most


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("flood"),
        *("--max-connections", "1024"),  # what pushes out is the reserve, not this cap
        launcher=("prlimit", f"--nofile={NOFILE}:{NOFILE}"),
    ) as server:
        yield server


def wait_for_closed(server: ServerProcess, kind: str, since: int, timeout: float = 60.0) -> None:
    """Until the server's log, from its `since`-th character, says it closed a connection of
    `kind` (the first of a flood is written at once, or at the end of an interval already
    counting others)."""
    deadline = time.monotonic() + timeout
    while not closed_counts(server.log()[since:])[kind]:
        assert time.monotonic() < deadline, f"no '{kind}' in the log:\n{server.log()[since:]}"
        time.sleep(0.2)


async def chat_turn(server: ServerProcess) -> str:
    async with await ChatClient.connect(server.ws) as chat:
        await chat.open()
        answer = await chat.ask("Say hello.", max_tokens=4, temperature=0.0)
    assert answer.finish_reason in ("stop", "length"), answer
    return answer.text


def completion(server: ServerProcess) -> str:
    """A chat completion's finish reason."""
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
    request = urllib.request.Request(
        server.http + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        reason: str = json.loads(reply.read())["choices"][0]["finish_reason"]
    return reason


async def others_served_during_a_flood(
    server: ServerProcess,
    sources: list[str],
    kind: str,
    *,
    sockets: int = SOCKETS,
    most_files: int = NOFILE - 1,
) -> tuple[FloodCounts, str]:
    """Flood from `sources` until the log shows a close of `kind`, then probe from 127.0.0.1;
    the flood's counts once it is stopped, and what the server logged meanwhile. The server
    holds at most `most_files` files at each /health probe."""
    since = len(server.log())
    flooder = start_flood(server.port, sockets, sources, seconds=300.0)
    files = 0
    try:
        await asyncio.to_thread(wait_for_closed, server, kind, since)
        for _ in range(HEALTH_PROBES):
            files = max(files, open_files(server.proc.pid))
            assert await asyncio.to_thread(probe_health, server.port) is not None
        assert await chat_turn(server) is not None
        assert await asyncio.to_thread(completion, server) in ("stop", "length")
        assert flooder.poll() is None, "the flood stopped before the probes ended"
    finally:
        counts = flood_result(flooder, stop=True)
    log = server.log()[since:]
    assert "Too many open files" not in log
    assert files <= most_files
    assert log.count("\n") < LOG_LINES_DURING, log[-5000:]
    assert counts.ended_by_server > sockets, counts  # each socket reopened, again and again
    return counts, log


@pytest.mark.usefixtures("balanced")
async def test_a_reconnect_flood_from_one_address_leaves_everyone_else_served(
    server: ServerProcess,
) -> None:
    _counts, log = await others_served_during_a_flood(server, ONE_CLIENT, RESET_OVER_CAP)
    assert PUSHED_OUT not in log, log  # the cap alone held it


@pytest.mark.usefixtures("balanced")
async def test_a_flood_from_many_addresses_past_the_descriptors_pushes_out_the_longest_waiting(
    server: ServerProcess,
) -> None:
    counts, log = await others_served_during_a_flood(server, TWELVE_CLIENTS, PUSHED_OUT)
    assert closed_counts(log)[PUSHED_OUT] > 0, counts


async def test_with_no_descriptors_kept_back_a_flood_reaching_the_limit_is_still_survived(
    tmp_path: Path,
) -> None:
    """--fd-reserve 0: the flood takes the process to its last descriptor; accept()'s EMFILE
    is met by the spare descriptor and by pushing out the longest waiting, never by asyncio's
    second without accepting (nor its log line)."""
    with running_server(
        tmp_path,
        *("--max-connections", "1024", "--fd-reserve", "0"),
        launcher=("prlimit", f"--nofile={NOFILE}:{NOFILE}"),
    ) as bare:
        counts, log = await others_served_during_a_flood(
            bare, TWELVE_CLIENTS, PUSHED_OUT, sockets=NOFILE + 200, most_files=NOFILE
        )
        assert closed_counts(log)[PUSHED_OUT] > 0, counts
        await wait_balanced(bare)
