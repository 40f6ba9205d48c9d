"""32 sessions streaming at once against a real server: every answer matches the same prompt
run alone (greedy, float32, near-ties excepted), and the event loop stays responsive."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from clients.chat_client import Answer, ChatClient
from tests.api.server import ServerProcess, running_server
from tests.engine.greedy import assert_same_answer

pytestmark = [
    pytest.mark.server,
    pytest.mark.real_model,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("balanced"),
]

SUBJECTS = [
    "the moon", "rivers", "bread", "owls", "glass", "volcanoes", "chess", "honey",
    "bicycles", "clouds", "salt", "whales", "paper", "trains", "coffee", "maps",
    "bees", "snow", "copper", "violins", "deserts", "tea", "lighthouses", "wolves",
    "clocks", "rain", "cheese", "kites", "coral", "bridges", "ink", "tigers",
]  # fmt: skip
# Not a speed figure (loadtest/ and docs/perf.md measure the lag): a bound that only work
# wrongly run on the event loop breaks (a prefill or a blocking Redis call takes seconds
# here), far above what a shared 2-core machine's scheduling adds (~100 ms seen under the
# full suite).
MAX_LAG_P99_MS = 500.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("server"), "--dtype", "float32") as server:
        yield server


async def ask_alone(server: ServerProcess, question: str) -> Answer:
    async with await ChatClient.connect(server.ws) as chat:
        await chat.open()
        return await chat.ask(question, max_tokens=8, temperature=0.0, logprobs=2)


async def test_32_concurrent_sessions_match_one_at_a_time(server: ServerProcess) -> None:
    questions = [f"Tell me one fact about {s}." for s in SUBJECTS]
    start = time.monotonic()
    together = await asyncio.gather(*(ask_alone(server, q) for q in questions))
    elapsed = time.monotonic() - start
    # They streamed at once: every answer had begun before any had ended.
    assert max(a.delta_times[0] for a in together) < min(a.delta_times[-1] for a in together)
    lag = (await server.astats_window(elapsed))["event_loop_lag"]
    assert lag["samples"] > 0 and lag["p99_ms"] < MAX_LAG_P99_MS, lag
    alone = [await ask_alone(server, q) for q in questions]
    for reference, got in zip(alone, together, strict=True):
        assert_same_answer(reference, got)
