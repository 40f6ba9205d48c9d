"""One request can fail; the engine cannot. Parameters are checked at the edge with their real
ranges, an error tied to one request fails only that request, and an engine that dies anyway
makes /health answer 503 at once and the process exit with status 3 for its supervisor.

Before: `{"seed": 2**70}` answered `internal: the engine failed: ValueError('Overflow when
unpacking long long')`, every later turn on every connection failed, and /health said 200.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from service.server.serve import EXIT_ENGINE_FAILED
from tests.api.server import (
    REDIS_URL,
    REPO,
    ServerProcess,
    delete_prefix,
    running_server,
    unique_prefix,
    wait_balanced,
)
from tests.tiny_model import make_tiny_llama

pytestmark = [pytest.mark.server, pytest.mark.timeout(240)]

GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("server"), "--model", str(tiny), "--dtype", "float32"
    ) as server:
        yield server


@pytest.fixture(autouse=True)
async def balanced(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    yield
    if "server" in request.fixturenames:
        await wait_balanced(request.getfixturevalue("server"))


async def _turn(ws: websockets.ClientConnection, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Send one user frame; the frames up to `done` or an error."""
    await ws.send(json.dumps({"type": "user", "content": "Hi", "params": params}))
    frames = []
    while True:
        frame = json.loads(await ws.recv())
        frames.append(frame)
        if frame["type"] in ("done", "error"):
            return frames


async def _session(server: ServerProcess) -> websockets.ClientConnection:
    ws = await websockets.connect(server.ws)
    await ws.send(json.dumps({"type": "open"}))
    assert json.loads(await ws.recv())["type"] == "session"
    return ws


@pytest.mark.parametrize(
    "params",
    [
        {"seed": 2**70},
        {"seed": 2**64 - 1},
        {"seed": 2**63},
        {"seed": -(2**63) - 1},
        {"max_tokens": 0},
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -1},
        {"logprobs": 21},
    ],
)
async def test_an_out_of_range_parameter_is_refused_and_the_engine_serves_on(
    server: ServerProcess, params: dict[str, Any]
) -> None:
    async with await _session(server) as ws, await _session(server) as other:
        [error] = await _turn(ws, {**GREEDY, **params})
        assert error["type"] == "error" and error["code"] == "invalid_params", error
        assert not error["fatal"]
        # The same connection and another one are answered as before.
        assert (await _turn(ws, GREEDY))[-1]["type"] == "done"
        assert (await _turn(other, GREEDY))[-1]["type"] == "done"
    assert server.get("/health")[0] == 200


async def test_the_edges_of_each_range_are_served(server: ServerProcess) -> None:
    async with await _session(server) as ws:
        for params in (
            {"seed": 2**63 - 1},
            {"seed": -(2**63)},
            {"top_k": 10**30},  # more than the vocabulary: no top-k at all
            {"temperature": 100, "top_p": 1e-9},
        ):
            frames = await _turn(ws, {**GREEDY, **params})
            assert frames[-1]["type"] == "done", (params, frames[-1])


def test_an_http_seed_whose_samples_overflow_is_a_400(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for extra in ({"seed": 2**63 - 1, "n": 2}, {"seed": 2**64 - 1}):
        request = urllib.request.Request(
            server.http + "/v1/chat/completions",
            data=json.dumps({**body, **extra}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        with refused.value as response:
            assert response.code == 400, response.read()
    status, _ = server.get("/health")
    assert status == 200


def test_lag_window_must_be_a_finite_positive_number(server: ServerProcess) -> None:
    for value in ("-1", "nan", "inf", "0", "x", "601"):
        status, body = server.get(f"/v1/stats?lag_window_s={value}")
        assert status == 400, (value, body)
    assert server.get("/v1/stats?lag_window_s=5")[0] == 200


async def test_a_dead_engine_fails_health_at_once_and_the_process_exits_3(
    tmp_path: Path, tiny: Path
) -> None:
    prefix = unique_prefix()
    log_path = tmp_path / "server.log"
    command = [
        *(sys.executable, "-m", "tests.api.failing_engine", "3", "serve", "--port", "0"),
        *("--model", str(tiny), "--dtype", "float32"),
        *("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--drain-timeout-s", "1"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 120
        while "Uvicorn running on" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        port = int(log_path.read_text().split("http://127.0.0.1:")[1].split()[0])
        server = ServerProcess(proc, port, log_path)
        assert server.get("/health")[0] == 200
        async with await _session(server) as ws:
            frames = await _turn(ws, {**GREEDY, "max_tokens": 50})
        # The engine died on its fourth step: the answer ends with an error, not a hang...
        assert frames[-1]["type"] == "error" and frames[-1]["code"] == "internal", frames[-1]
        # ...the replica says it is unhealthy, and the process exits for its supervisor.
        code = proc.wait(60)
        assert code == EXIT_ENGINE_FAILED, log_path.read_text()
        assert "InjectedFault" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        delete_prefix(prefix)
