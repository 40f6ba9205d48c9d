"""A seeded request on a busy server (`--batch-invariant`, the bundled model): sent five times
while eight other streams run, it gets the idle server's answer each time, token for token."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.api.server import ServerProcess, running_server

pytestmark = [pytest.mark.server, pytest.mark.timeout(600), pytest.mark.usefixtures("balanced")]

SEEDED: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
    "temperature": 1.0, "seed": 1234, "max_tokens": 48, "ignore_eos": True, "logprobs": True,
}  # fmt: skip
STORY = "Tell me a long story about a lighthouse keeper and the ships he saw. " * 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("invariant"), "--batch-invariant", "--max-model-len", "1024"
    ) as server:
        yield server


def tokens(answer: dict[str, Any]) -> list[str]:
    return [entry["token"] for entry in answer["choices"][0]["logprobs"]["content"]]


async def test_a_seeded_answer_is_the_idle_ones_while_eight_streams_run(
    server: ServerProcess,
) -> None:
    async with httpx.AsyncClient(base_url=server.http, timeout=300) as client:
        idle = (await client.post("/v1/chat/completions", json=SEEDED)).json()
        assert len(tokens(idle)) == SEEDED["max_tokens"]

        async def stream(i: int) -> int:
            body = {"messages": [{"role": "user", "content": f"{i}: {STORY}"}],
                    "max_tokens": 700, "ignore_eos": True, "stream": True}  # fmt: skip
            chunks = 0
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    chunks += 1
            return chunks

        others = [asyncio.create_task(stream(i)) for i in range(8)]
        await asyncio.sleep(0.5)  # the eight prefilling and decoding
        busy = []
        for _ in range(5):
            answer = (await client.post("/v1/chat/completions", json=SEEDED)).json()
            busy.append(tokens(answer))
            assert not all(task.done() for task in others), "the others ended first"
        assert min(await asyncio.gather(*others)) > 600
    assert busy == [tokens(idle)] * 5
