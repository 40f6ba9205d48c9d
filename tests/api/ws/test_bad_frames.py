"""Frames a client gets wrong are the client's fault: answered or closed as documented, and
never logged as a server error (before: an invalid UTF-8 text frame was closed with 1007, right,
but logged an ERROR with a traceback)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets

from tests.api.server import ServerProcess, running_server
from tests.tiny_model import make_tiny_llama

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory: Path = tmp_path_factory.mktemp("bad-frames")
    model = make_tiny_llama(directory / "tiny")
    with running_server(directory, "--model", str(model), "--dtype", "float32") as server:
        yield server


async def test_an_invalid_utf8_text_frame_closes_1007_and_logs_no_error(
    server: ServerProcess,
) -> None:
    async with websockets.connect(server.ws) as ws:
        await ws.send(b'{"type": "open", "system": "\xff\xfe"}', text=True)
        with pytest.raises(websockets.ConnectionClosedError) as closed:
            await ws.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1007
    log = server.log()
    assert "Invalid UTF-8 sequence received from client." in log
    assert " ERROR " not in log and "Traceback" not in log, log


@pytest.mark.parametrize("levels", [200, 30_000])
async def test_a_frame_nested_deep_in_its_response_format_is_a_bad_frame_not_a_drop(
    server: ServerProcess, levels: int
) -> None:
    """30,000 levels are past the decoder's own bound (it raised RecursionError, which dropped
    the connection: 1006); 200 decode, and are refused before any code walks them."""
    nested = "[" * levels + "]" * levels
    frame = (
        '{"type": "user", "content": "Hi", "params": {"response_format": {"type": '
        '"json_schema", "json_schema": {"name": "x", "schema": {"description": ' + nested + "}}}}}"
    )
    async with websockets.connect(server.ws) as ws:
        await ws.send('{"type": "open"}')
        assert json.loads(await ws.recv())["type"] == "session"
        await ws.send(frame)
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["code"] == "bad_frame", error
        assert "nests" in error["message"] and not error["fatal"]
        await ws.send('{"type": "user", "content": "Hi", "params": {"max_tokens": 2}}')
        while (frame_type := json.loads(await ws.recv())["type"]) == "delta":
            pass
        assert frame_type == "done"  # the connection goes on
    log = server.log()
    assert " ERROR " not in log and "Traceback" not in log, log
