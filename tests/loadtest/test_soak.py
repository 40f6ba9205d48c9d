"""loadtest/soak.py: the verdict's rules on made-up samples and keys, and one short real soak
(its own server and embedded Redis, every scenario) whose verdict passes."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from loadtest.redis_child import RedisChild
from loadtest.run import SCENARIOS
from loadtest.soak import parse_args, report
from loadtest.soak_probe import is_idle
from loadtest.soak_verdict import (
    Check,
    KeyAccount,
    SessionMeta,
    account_keys,
    check_keys,
    check_rss,
    flatness,
)
from tests.api.server import REPO

P = "soak-test:"
TTL = 3600


def _rss_run(n: int, growth_per_sample: float) -> tuple[list[float], list[float]]:
    """n samples 5 s apart: a warm-up ramp over the first eighth, then 1,000 MB plus
    `growth_per_sample` MB a sample and a little jitter."""
    times = [5.0 * i for i in range(n)]
    values = [
        1000.0 * min(1.0, (i + 1) / (n / 8)) + growth_per_sample * i + (i % 3 - 1) * 2.0
        for i in range(n)
    ]
    return times, values


def test_a_flat_rss_after_warm_up_passes_whatever_the_ramp() -> None:
    times, values = _rss_run(120, 0.0)
    f = flatness(times, values)
    assert abs(f.growth) < 0.005 and abs(f.slope_per_h) < 10
    assert check_rss(times, values, 0.05).ok is True


def test_an_rss_that_keeps_growing_fails_and_the_slope_measures_it() -> None:
    times, values = _rss_run(120, 1.0)  # 1 MB a sample: 720 MB/h, +6% between the quarters
    f = flatness(times, values)
    assert f.slope_per_h == pytest.approx(720, rel=0.02)
    assert 0.05 < f.growth < 0.08
    check = check_rss(times, values, 0.05)
    assert check.ok is False and "bound +5%" in check.detail
    assert check_rss(times, values, 0.10).ok is True


def test_the_quarters_compared_are_the_second_and_the_last() -> None:
    values = [9.0, 9.0, 1.0, 1.0, 5.0, 5.0, 2.0, 2.0]  # a warm-up spike, then 1 -> 2
    f = flatness([float(i) for i in range(8)], values)
    assert (f.warm, f.end, f.growth) == (1.0, 2.0, 1.0)


def test_too_few_or_unknown_rss_samples_are_not_judged() -> None:
    with pytest.raises(ValueError):
        flatness([0.0] * 7, [1.0] * 7)
    assert check_rss([0.0] * 7, [1.0] * 7, 0.05).ok is None
    assert check_rss([float(i) for i in range(10)], [math.nan] * 10, 0.05).ok is None


def _session(sid: str, turns: int) -> dict[str, int]:
    keys = {f"{P}session:{sid}": TTL}
    if turns:
        keys |= {f"{P}session:{sid}:messages": TTL, f"{P}session:{sid}:pagemap": TTL}
    return keys


def test_keys_of_sessions_with_and_without_turns_are_accounted_for_by_kind() -> None:
    ttls = _session("aaaaaaaa", 0) | _session("bbbbbbbb", 2) | _session("cccccccc", 1)
    metas = {
        "aaaaaaaa": SessionMeta(0, system=False),
        "bbbbbbbb": SessionMeta(2, system=True),
        "cccccccc": SessionMeta(1, system=False),
    }
    account = account_keys(P, ttls, metas)
    assert account.problems == []
    assert account.keys == 7 and account.sessions == 3
    assert account.by_kind == {"meta": 3, "messages": 2, "pagemap": 2, "lease": 0}
    assert (account.sessions_with_turns, account.sessions_with_system) == (2, 1)


ONE_TURN = {sid: SessionMeta(1, False) for sid in ("eeeeeeee", "ffffffff", "hhhhhhhh")}


@pytest.mark.parametrize(
    ("ttls", "problem"),
    [
        ({f"{P}session:dddddddd:messages": TTL}, "without metadata"),  # an orphan
        (_session("eeeeeeee", 1) | {f"{P}session:eeeeeeee": -1}, "no TTL"),
        ({f"{P}other:thing": TTL}, "not a session key"),
        (_session("ffffffff", 0), "1 turns"),  # metadata says 1 turn, no history
        (_session("gggggggg", 1), "0 turns"),  # a history, metadata says none (not in ONE_TURN)
        (_session("hhhhhhhh", 1) | {f"{P}session:hhhhhhhh:lease": 20}, "turn lease"),
    ],
    ids=["orphan", "no-ttl", "foreign", "turns-without-history", "history-without-turns", "lease"],
)
def test_keys_that_do_not_fit_the_store_are_problems(ttls: dict[str, int], problem: str) -> None:
    metas = ONE_TURN | {"gggggggg": SessionMeta(0, False)}
    account = account_keys(P, ttls, metas)
    assert any(problem in p for p in account.problems), account.problems
    assert check_keys(account, None, users=5).ok is False


def test_the_sessions_must_number_locusts_opens() -> None:
    account = KeyAccount(by_kind={"meta": 10, "messages": 0, "pagemap": 0, "lease": 0})
    assert check_keys(account, opens=10, users=5).ok is True
    assert check_keys(account, opens=6, users=5).ok is True  # four opens cut off at the end
    assert check_keys(account, opens=11, users=5).ok is False  # a session lost
    assert check_keys(account, opens=4, users=5).ok is False  # sessions nobody opened
    assert check_keys(account, opens=None, users=5).ok is True


def _stats(**busy: int) -> dict[str, object]:
    pool = {"total": 8, "free": 8, "cached": 0, "in_use": busy.get("in_use", 0)}
    return {
        "kv": {"device": pool, "cpu": {**pool, "in_use": 0}},
        "queue": {"waiting": 0, "running": busy.get("running", 0), "swapped": 0,
                  "inflight_turns": 0},
        "sessions": {"open_connections": busy.get("connections", 0)},
    }  # fmt: skip


def test_idle_means_no_block_request_or_connection() -> None:
    assert is_idle(_stats())
    assert not is_idle(_stats(in_use=1))
    assert not is_idle(_stats(running=1))
    assert not is_idle(_stats(connections=1))


def test_a_failed_check_fails_the_verdict_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checks = [Check("blocks", True, "0"), Check("rss flat", False, "+9%"), Check("x", None, "")]
    assert report(checks, {"users": 5}, tmp_path, doc=False) == 1
    assert "verdict: FAIL (rss flat)" in capsys.readouterr().out
    assert report(checks[:1] + checks[2:], {}, tmp_path, doc=False) == 0
    assert json.loads((tmp_path / "verdict.json").read_text())["checks"][0]["ok"] is True


def test_every_scenario_needs_a_user_and_a_foreign_server_its_redis() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--users", str(len(SCENARIOS) - 1)])
    with pytest.raises(SystemExit):
        parse_args(["--url", "ws://127.0.0.1:1"])
    args, extra = parse_args(["--", "--think-time", "1"])
    assert args.own_prefix and args.redis_prefix.startswith("pagechat-soak-")
    assert extra == ["--think-time", "1"]


@pytest.mark.server
def test_the_soaks_own_redis_answers_on_its_socket_and_persists_when_stopped(
    tmp_path: Path,
) -> None:
    server = RedisChild(tmp_path / "redis")
    server.start()
    socket = Path(server.socket_path)
    try:
        client = redis.Redis.from_url(server.url)
        assert client.set("soak", "1") and client.get("soak") == b"1"
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        client.close()
    finally:
        server.stop()
    assert not socket.exists() and not socket.parent.exists()
    assert b"soak" in (tmp_path / "redis" / "appendonly.aof").read_bytes()  # synced at SIGTERM
    server.stop()  # twice: nothing left to stop


@pytest.mark.real_model
@pytest.mark.timeout(240)
@pytest.mark.server
def test_a_short_soak_of_every_scenario_passes_its_verdict_and_writes_its_files(
    tmp_path: Path,
) -> None:
    results = tmp_path / "soak"
    command = [
        sys.executable,
        "-m",
        "loadtest.soak",
        *("--duration", "20s", "--users", str(len(SCENARIOS)), "--spawn-rate", "5"),
        *("--interval", "1", "--results", str(results)),
        *("--", "--think-time", "1", "--away-time", "3", "--max-tokens", "16"),
    ]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    assert "verdict: PASS" in run.stdout
    verdict = json.loads((results / "verdict.json").read_text())
    checks = {c["name"]: c["ok"] for c in verdict["checks"]}
    assert checks == dict.fromkeys(
        ("failures", "blocks", "rss flat", "redis keys", "shutdown"), True
    )
    figures = verdict["figures"]
    assert figures["failures"] == 0 and all(figures["turns_by_scenario"].values())
    assert figures["sessions"] == figures["locust_opens"] > 0
    assert figures["keys_by_kind"]["messages"] > 0
    assert figures["server_turns"] >= figures["turns"] > 0
    with (results / "samples.csv").open() as f:
        rows = list(csv.DictReader(f))
    load = [r for r in rows if r["phase"] == "load"]
    assert len(load) >= 15, rows
    assert all(float(r["rss_mb"]) > 100 and int(r["open_fds"]) > 0 for r in rows)
    assert max(int(r["device_in_use"]) for r in load) > 0
    assert rows[-1]["phase"] == "idle" and rows[-1]["device_in_use"] == "0"
    assert int(rows[-1]["redis_keys"]) == figures["redis_keys"]
    assert (results / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (results / "locust" / "summary.json").exists()
