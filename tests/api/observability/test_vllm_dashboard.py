"""vLLM's example Grafana dashboard against a real server: a real Prometheus (Debian's
`prometheus`) scrapes a real `pagechat serve` every second while answers of every kind go
through it, then every panel's query, as the dashboard writes it with `vllm:` renamed
`pagechat_`, is run on Prometheus: each has data.

The queries are those of vLLM's examples/online_serving/prometheus_grafana/grafana.json (12
panels), `$model_name` set to the served name and `$__rate_interval` to 1m (Grafana's would
be 4 scrape intervals at least; a minute covers the whole run)."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.peer_servers import free_port
from clients.chat_client import ChatClient
from tests.api.server import ServerProcess, running_server
from tests.tiny_model import make_tiny_llama

pytestmark = [
    pytest.mark.server,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        shutil.which("prometheus") is None, reason="prometheus missing: apt-get install prometheus"
    ),
]

NAME = "dash-model"


def _quantiles(metric: str) -> list[str]:
    return [
        f'histogram_quantile({q}, sum by(le) (rate({metric}_bucket{{model_name="$model_name"}}[$__rate_interval])))'  # noqa: E501
        for q in (0.99, 0.95, 0.9, 0.5)
    ] + [
        f'rate({metric}_sum{{model_name="$model_name"}}[$__rate_interval])\n/\n'
        f'rate({metric}_count{{model_name="$model_name"}}[$__rate_interval])'
    ]


PANELS: dict[str, list[str]] = {
    "E2E Request Latency": _quantiles("vllm:e2e_request_latency_seconds"),
    "Token Throughput": [
        'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
        'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    ],
    "Time Per Output Token Latency": _quantiles("vllm:time_per_output_token_seconds"),
    "Scheduler State": [
        'vllm:num_requests_running{model_name="$model_name"}',
        'vllm:num_requests_waiting{model_name="$model_name"}',
    ],
    "Time To First Token Latency": _quantiles("vllm:time_to_first_token_seconds"),
    "Cache Utilization": ['vllm:gpu_cache_usage_perc{model_name="$model_name"}'],
    "Request Prompt Length": [
        'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))'  # noqa: E501
    ],
    "Request Generation Length": [
        'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))'  # noqa: E501
    ],
    "Finish Reason": [
        'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))'  # noqa: E501
    ],
    "Queue Time": [
        'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])'
    ],
    "Requests Prefill and Decode Time": [
        'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
        'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    ],
    "Max Generation Token in Sequence Group": [
        'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])'
    ],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("dashboard")
    model = make_tiny_llama(directory / "model")
    with running_server(
        directory,
        *("--model", str(model), "--dtype", "float32", "--max-model-len", "512"),
        *("--default-max-tokens", "8", "--served-model-name", NAME),
    ) as server:
        yield server


@pytest.fixture
def prometheus(server: ServerProcess, tmp_path: Path) -> Iterator[str]:
    """A Prometheus scraping the server's /metrics every second; its HTTP API's URL."""
    target = server.http.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: pagechat\n    static_configs:\n"
        f"      - targets: ['{target}']\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            "prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not _targets_up(url):
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "prometheus never scraped the server"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def _targets_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/api/v1/targets", timeout=2) as response:
            targets = json.loads(response.read())["data"]["activeTargets"]
    except OSError:
        return False
    return bool(targets) and all(t["health"] == "up" for t in targets)


def query(url: str, expr: str) -> list[dict[str, Any]]:
    promql = expr.replace("vllm:", "pagechat_").replace("$model_name", NAME)
    promql = promql.replace("$__rate_interval", "1m")
    params = urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(f"{url}/api/v1/query?{params}", timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def complete(server: ServerProcess, **body: Any) -> None:
    request = urllib.request.Request(
        server.http + "/v1/chat/completions",
        data=json.dumps({"messages": [{"role": "user", "content": "Hi"}], **body}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


async def traffic(server: ServerProcess) -> None:
    """Answers of each kind: whole and streamed, n > 1, cut by length, ended by their grammar
    (stop: the tiny random model never writes its end of turn), and a WebSocket turn
    cancelled (vLLM's abort)."""
    await asyncio.to_thread(complete, server, temperature=0.0)
    await asyncio.to_thread(complete, server, guided_choice=["yes", "no"])
    await asyncio.to_thread(complete, server, max_tokens=3, n=2, temperature=1.0)
    await asyncio.to_thread(complete, server, stream=True, temperature=0.5)
    async with await ChatClient.connect(server.ws) as chat:
        await chat.open()
        await chat.ask("Hello", max_tokens=6)
        await chat.send_user("Tell me more", max_tokens=200, ignore_eos=True)
        await chat.cancel()
        await chat.collect()


async def test_every_panel_of_vllms_dashboard_has_data(
    server: ServerProcess, prometheus: str
) -> None:
    # Two waves a few scrapes apart, so that every counter and histogram moves between
    # samples (a rate over one unchanged series would be 0, still data, but says little).
    await traffic(server)
    await asyncio.sleep(3)
    await traffic(server)
    await asyncio.sleep(3)
    empty = []
    for title, exprs in PANELS.items():
        for expr in exprs:
            result = await asyncio.to_thread(query, prometheus, expr)
            values = [float(r["value"][1]) for r in result]
            if not values or all(math.isnan(v) for v in values):
                empty.append((title, expr, result))
    assert not empty, empty
    reasons = await asyncio.to_thread(query, prometheus, PANELS["Finish Reason"][0])
    assert {r["metric"]["finished_reason"] for r in reasons} == {"stop", "length", "abort"}
