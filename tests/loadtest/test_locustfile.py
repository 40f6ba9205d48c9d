"""loadtest/locustfile.py through `loadtest.run`: a short headless Locust run against a real
server on loopback. Locust runs as a subprocess, which keeps gevent's monkey-patching (and its
warnings) out of pytest.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.run import SCENARIOS
from tests.api.server import (
    REDIS_URL,
    REPO,
    delete_prefix,
    start_server,
    unique_prefix,
    wait_balanced,
)

pytestmark = [pytest.mark.server, pytest.mark.real_model, pytest.mark.timeout(300)]


async def test_a_short_run_exercises_every_scenario_without_failures_and_leaves_the_pool_balanced(
    tmp_path: Path,
) -> None:
    prefix = unique_prefix()
    server = start_server(
        tmp_path / "server.log", "--redis-url", REDIS_URL, "--redis-prefix", prefix
    )
    results = tmp_path / "results"
    try:
        # One user per scenario; short think and away times, so that returning users return.
        command = [
            sys.executable,
            "-m",
            "loadtest.run",
            "--url",
            f"ws://127.0.0.1:{server.port}",
            "--users",
            str(len(SCENARIOS)),
            "--spawn-rate",
            str(len(SCENARIOS)),
            "--run-time",
            "30s",
            "--results",
            str(results),
            "--",
            "--think-time",
            "1",
            "--away-time",
            "3",
            "--max-tokens",
            "16",
        ]
        run = await asyncio.to_thread(
            subprocess.run, command, cwd=REPO, capture_output=True, text=True, timeout=180
        )
        log = (results / "locust.log").read_text(errors="replace")
        assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{log}"
        summary = json.loads((results / "summary.json").read_text())
        assert summary["failures"] == 0, log
        assert all(summary["turns_by_scenario"][s] > 0 for s in SCENARIOS), summary
        final = {
            (e["method"], e["name"]): e
            for e in json.loads((results / "locust_final.json").read_text())
        }
        assert final[("session", "resume")]["num_requests"] > 0  # returning users came back
        for kind in ("ttft", "itl"):
            assert final[(kind, "all")]["num_requests"] > 0
        assert final[("share", "cached %")]["num_requests"] == summary["turns"]
        assert summary["tokens_per_s"] > 0
        assert "failures 0" in run.stdout
        assert (results / "report.html").stat().st_size > 0
        assert (results / "locust_stats.csv").exists()
        await wait_balanced(server, timeout=30)
    finally:
        code = server.stop()
        delete_prefix(prefix)
    assert code == 0, server.log()
