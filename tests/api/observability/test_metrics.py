"""/metrics of a real `pagechat serve` (the tiny model), read with prometheus_client's own
parser as a scraper reads it: every pagechat_ series labelled with the served model name (as
vLLM's carry theirs), token counters that move by exactly what each answer's usage says, and
the server process's own process_ metrics."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from clients.chat_client import ChatClient
from tests.api.server import ServerProcess, running_server
from tests.tiny_model import make_tiny_llama

pytestmark = [pytest.mark.server, pytest.mark.timeout(240), pytest.mark.usefixtures("balanced")]

NAMES = ("smol-chat", "gpt-4o-mini")  # --served-model-name: metrics carry the first
HI = [{"role": "user", "content": "Hello there"}]
# The request metrics a vLLM dashboard graphs, under pagechat_ names (docs/protocol.md).
REQUEST_FAMILIES = {
    "pagechat_time_to_first_token_seconds",
    "pagechat_inter_token_latency_seconds",
    "pagechat_e2e_request_latency_seconds",
    "pagechat_request_queue_time_seconds",
    "pagechat_prompt_tokens",
    "pagechat_generation_tokens",
    "pagechat_turns",
    "pagechat_num_requests_running",
    "pagechat_num_requests_waiting",
    "pagechat_kv_cache_usage_perc",
}
COUNTERS = (
    "pagechat_prompt_tokens_total",
    "pagechat_prompt_tokens_computed_total",
    "pagechat_generation_tokens_total",
    "pagechat_time_to_first_token_seconds_count",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("metrics")
    model = make_tiny_llama(directory / "model")
    with running_server(
        directory,
        *("--model", str(model), "--dtype", "float32", "--max-model-len", "512"),
        *("--default-max-tokens", "8", "--served-model-name", ",".join(NAMES)),
    ) as server:
        yield server


def complete(server: ServerProcess, **body: Any) -> dict[str, Any]:
    request = urllib.request.Request(
        server.http + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def counters(server: ServerProcess) -> dict[str, float]:
    return {name: server.metric(name, model_name=NAMES[0]) for name in COUNTERS}


def moved(server: ServerProcess, before: dict[str, float]) -> dict[str, float]:
    return {name: value - before[name] for name, value in counters(server).items()}


async def test_every_pagechat_series_carries_the_first_served_name(server: ServerProcess) -> None:
    await asyncio.to_thread(complete, server, messages=HI, max_tokens=3)
    async with await ChatClient.connect(server.ws) as chat:
        await chat.open()
        await chat.ask("Hello!", max_tokens=3)
    families = await asyncio.to_thread(server.metrics)
    assert families.keys() >= REQUEST_FAMILIES
    assert all(families[name].samples for name in REQUEST_FAMILIES)
    ours = [f for name, f in families.items() if name.startswith("pagechat_")]
    for family in ours:  # a labelled family nothing was counted in yet has no samples
        for sample in family.samples:
            assert sample.labels.get("model_name") == NAMES[0], sample
    turns = families["pagechat_turns"].samples
    assert any(s.labels.keys() == {"model_name", "finish_reason"} for s in turns)
    # The process's own series keep the names and labels every exporter gives them.
    assert all(
        "model_name" not in s.labels
        for name, f in families.items()
        if not name.startswith("pagechat_")
        for s in f.samples
    )


def test_token_counters_move_by_each_answers_usage(server: ServerProcess) -> None:
    before = counters(server)
    sampled = {"temperature": 0.8, "seed": 3, "ignore_eos": True}
    first = complete(server, messages=HI, max_tokens=5, n=2, **sampled)
    again = [*HI, first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    second = complete(server, messages=again, max_tokens=3, **sampled)
    usages = [first["usage"], second["usage"]]
    delta = moved(server, before)
    # All prompt tokens, cached or not, once per request (n=2 shares one prompt).
    assert delta["pagechat_prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0, "the resent conversation is a prefix-cache hit"
    assert delta["pagechat_prompt_tokens_computed_total"] == (
        delta["pagechat_prompt_tokens_total"] - cached
    )
    assert delta["pagechat_generation_tokens_total"] == 2 * 5 + 3
    assert sum(u["completion_tokens"] for u in usages) == 2 * 5 + 3
    assert delta["pagechat_time_to_first_token_seconds_count"] == 2  # one per request


async def test_a_websocket_turn_counts_its_prompt_once_not_the_caching_of_its_tail(
    server: ServerProcess,
) -> None:
    """After each answer the server computes the K/V of the stored turn's tail (a prefill-only
    request over the whole conversation): real work, counted as computed, but nobody's prompt."""
    async with await ChatClient.connect(server.ws) as chat:
        await chat.open()
        for content in ("Hello!", "Tell me more."):
            before = await asyncio.to_thread(counters, server)
            answer = await chat.ask(content, max_tokens=4, ignore_eos=True)
            usage = answer.usage
            # Wait for the tail's computation: more computed than this turn's own prompt.
            delta = await asyncio.to_thread(moved, server, before)
            deadline = time.monotonic() + 30
            while delta["pagechat_prompt_tokens_computed_total"] <= usage.recomputed_tokens:
                assert time.monotonic() < deadline, f"the tail was never computed: {delta}"
                await asyncio.sleep(0.02)
                delta = await asyncio.to_thread(moved, server, before)
            assert delta["pagechat_prompt_tokens_total"] == usage.prompt_tokens
            assert delta["pagechat_generation_tokens_total"] == usage.completion_tokens == 4


def test_process_metrics_describe_the_server_process(server: ServerProcess) -> None:
    process = psutil.Process(server.proc.pid)
    families = server.metrics()
    value = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
    # The server's start, not the test's: both read the kernel's record of the process.
    assert abs(value["process_start_time_seconds"] - process.create_time()) < 1.0
    assert 0.5 < value["process_resident_memory_bytes"] / process.memory_info().rss < 2.0
    assert 3 <= value["process_open_fds"] <= value["process_max_fds"]
    cpu_before = value["process_cpu_seconds_total"]
    # /proc counts CPU time in clock ticks (10 ms); 32 forward passes spend several.
    complete(server, messages=HI, max_tokens=32, ignore_eos=True)
    assert server.metric("process_cpu_seconds_total") > cpu_before
    (info,) = families["python_info"].samples
    assert info.labels["implementation"] == "CPython"
