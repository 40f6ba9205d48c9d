"""`make soak`: Locust for a long while against a server of its own, sampled, plotted, judged.

    .venv/bin/python -m loadtest.soak --duration 10m --users 24 [--interval 5] [--doc] \\
        [-- any loadtest.run / locust option, e.g. --think-time 2]
    .venv/bin/python -m loadtest.soak --redis-url redis://127.0.0.1:6379/0   # that Redis
    .venv/bin/python -m loadtest.soak --url ws://127.0.0.1:8000 --redis-url redis://... \\
        --redis-prefix pagechat: [--server-pid PID]                   # a server already running

By default it starts a Redis of its own (loadtest/redis_child.py: `pagechat serve`'s embedded
Redis run on its own, in a temporary data directory) and `pagechat serve`
(bundled model) on a free loopback port against it under a fresh key prefix, then runs every
scenario of loadtest/locustfile.py headless through `loadtest.run` for the duration. Every
--interval seconds it samples the server's RSS and open file descriptors (psutil), the prefix's
Redis key count (SCAN) and Redis's used memory, the KV blocks in use in both pools and the
event-loop lag p99 over the interval (/v1/stats), and the turns (/metrics) and tokens served so
far. Results go to results/soak-<time>/: samples.csv, soak.png, verdict.json, server.log and
Locust's files under locust/; --doc copies the plot to docs/img/soak.png.

When Locust stops it waits for the server to go idle, then judges (exit status 1 when any check
fails, each failure named):
- failures: Locust counted none, and every scenario finished turns;
- blocks: no KV block in use in either pool, each pool balanced (free + cached + in use = total);
- rss flat: the median RSS of the load's last quarter within --rss-growth (5%) of its second
  quarter's. The first quarter is warm-up (users ramp up, batches reach their largest shapes, the
  prefix cache and the allocators fill; its own server's KV pools are taken whole at start,
  `--kv-pool-pages eager`, as lazily taken they grow while the cache fills). Medians, because a
  steady server's RSS swings by 1-2% from sample to sample as malloc's arenas grow and trim (a
  least-squares slope follows those swings; it is printed, not judged). 5% leaves room for that
  and still catches a leak of ~150 KB a turn in a 10-minute soak at 24 users (~1,300 turns, ~1.9
  GB RSS with the bundled model): a leaked request, step tensor or decoder state, not a few bytes
  a turn. The bound is relative and a leak grows with the run, so a longer soak catches a smaller
  one.
- redis keys: every key under the prefix is a session's metadata, messages or page map (the
  layout of service/sessions/store.py) whose metadata exists, has a TTL, and agrees with the
  session's turn count (messages and page map once it has turns, neither before); no turn lease
  is left; under a prefix of its own, the sessions number Locust's opens (plus at most one a
  user, for opens the stop timeout cut off);
- shutdown: SIGTERM, exit code 0 (drained, KV pools balanced); only for its own server.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis

from loadtest.redis_child import RedisChild
from loadtest.run import REPO, SCENARIOS
from loadtest.soak_probe import Probe, Sample, is_idle, plot, write_csv
from loadtest.soak_verdict import Check, check_keys, check_rss

_RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


# ---------------------------------------------------------------- the run


def start_server(
    redis_url: str, prefix: str, log_path: Path
) -> tuple[subprocess.Popen[bytes], int]:
    """`pagechat serve` on a free loopback port; (process, port) once it listens."""
    command = [sys.executable, "-m", "service.cli", "serve", "--port", "0"]
    command += ["--redis-url", redis_url, "--redis-prefix", prefix]
    # The KV pools take their memory at start-up: taken as the prefix cache fills them (the
    # default), they grow the RSS for as long as the cache has room, which is not a leak.
    command += ["--kv-pool-pages", "eager"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if match := _RUNNING.search(log_path.read_text(errors="replace")):
            return proc, int(match.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not start; see {log_path}")


def stop_server(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM (graceful: drain, then exit 0 when the KV pools balance); its exit code."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -int(signal.SIGKILL)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--duration", default="10m", help="Locust's run time: 90s, 10m, 1h")
    parser.add_argument("--users", type=int, default=24, help="one scenario per user at least")
    parser.add_argument("--spawn-rate", type=float, default=2.0, help="users started per second")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--rss-growth", type=float, default=0.05, help="bound of the RSS check")
    parser.add_argument("--idle-timeout", type=float, default=120.0, help="for the server to idle")
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--server-pid", type=int, help="its process, for RSS and open files")
    parser.add_argument("--redis-url", help="default: an embedded Redis in a temporary dir")
    parser.add_argument("--redis-prefix", help="with --url (default pagechat:)")
    parser.add_argument("--results", type=Path, help="default: results/soak-<UTC time>")
    parser.add_argument("--doc", action="store_true", help="copy the plot to docs/img/soak.png")
    args, extra = parser.parse_known_args(argv)
    if args.users < len(SCENARIOS):
        parser.error(f"--users must be {len(SCENARIOS)} or more: one for each scenario")
    if args.url is not None and args.redis_url is None:
        parser.error("--url needs --redis-url: the server's Redis, to account for its keys")
    # A prefix of our own is empty at the start, and its keys are deleted at the end.
    args.own_prefix = args.redis_prefix is None and args.url is None
    if args.redis_prefix is None:
        args.redis_prefix = (
            f"pagechat-soak-{uuid.uuid4().hex[:8]}:" if args.own_prefix else "pagechat:"
        )
    return args, [a for a in extra if a != "--"]


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    results: Path = args.results or REPO / "results" / time.strftime(
        "soak-%Y%m%dT%H%M%SZ", time.gmtime()
    )
    results.mkdir(parents=True, exist_ok=True)
    own_server = args.url is None
    prefix = args.redis_prefix
    scratch = Path(tempfile.mkdtemp(prefix="pagechat-soak-"))
    embedded = None
    server: subprocess.Popen[bytes] | None = None
    client: redis.Redis | None = None
    try:
        redis_url = args.redis_url
        if redis_url is None:
            embedded = RedisChild(scratch / "redis")
            embedded.start()
            redis_url = embedded.url
        client = redis.Redis.from_url(redis_url)
        url, pid = args.url, args.server_pid
        if own_server:
            server, port = start_server(redis_url, prefix, results / "server.log")
            url, pid = f"ws://127.0.0.1:{port}", server.pid
        probe = Probe(url, pid, client, prefix, args.interval)
        checks, figures = soak(args, extra, probe, results)
        if server is not None:
            code = stop_server(server)
            server = None
            checks.append(Check("shutdown", code == 0, f"SIGTERM: exit code {code}"))
        else:
            checks.append(Check("shutdown", None, "not our server: left running"))
    finally:
        if server is not None:
            stop_server(server)
        if client is not None:
            if args.own_prefix and embedded is None:
                keys = list(client.scan_iter(match=prefix + "*", count=1000))
                if keys:
                    client.delete(*keys)
            client.close()
        if embedded is not None:
            embedded.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return report(checks, figures, results, args.doc)


def soak(
    args: argparse.Namespace, extra: list[str], probe: Probe, results: Path
) -> tuple[list[Check], dict[str, Any]]:
    """Locust for the duration, sampled; the wait for the server to go idle; the checks that
    need it still up; the CSV file and the plot."""
    command = [sys.executable, "-m", "loadtest.run", "--url", probe.base, "--users"]
    command += [str(args.users), "--spawn-rate", str(args.spawn_rate), "--run-time"]
    command += [args.duration, "--results", str(results / "locust"), "--", *extra]
    samples: list[Sample] = []
    started = time.monotonic()
    every_minute = max(1, round(60 / args.interval))
    with (results / "locust-run.log").open("wb") as log:
        # A process group of its own: loadtest.run's Locust child goes too if we stop early.
        locust = subprocess.Popen(
            command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while locust.poll() is None:
                tick = time.monotonic()
                samples.append(s := probe.sample(tick - started, "load"))
                if len(samples) % every_minute == 0:
                    print(f"{s.t_s / 60:4.1f} min: {s.turns} turns, RSS {s.rss_mb:.0f} MB")
                time.sleep(max(0.0, args.interval - (time.monotonic() - tick)))
        finally:
            if locust.poll() is None:
                os.killpg(locust.pid, signal.SIGTERM)
            locust_status = locust.wait()
    deadline = time.monotonic() + args.idle_timeout
    while not is_idle(stats := probe.stats()) and time.monotonic() < deadline:
        samples.append(probe.sample(time.monotonic() - started, "idle"))
        time.sleep(args.interval)
    samples.append(probe.sample(time.monotonic() - started, "idle"))
    write_csv(samples, results / "samples.csv")
    plot(samples, results / "soak.png", f"soak: {args.users} users, {args.duration}")

    summary_path = results / "locust" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    final_path = results / "locust" / "locust_final.json"
    final = json.loads(final_path.read_text()) if final_path.exists() else []
    opens = sum(
        e["num_requests"] - e["num_failures"]
        for e in final
        if (e["method"], e["name"]) == ("session", "open")
    )
    turns = summary.get("turns_by_scenario", {})
    pools = [stats["kv"]["device"], stats["kv"]["cpu"]]
    load = [s for s in samples if s.phase == "load"]
    account = probe.account()
    checks = [
        Check(
            "failures",
            locust_status == 0
            and summary.get("failures") == 0
            and all(turns.get(s, 0) > 0 for s in SCENARIOS),
            f"Locust exit {locust_status}, failures {summary.get('failures')}, turns {turns}",
        ),
        Check(
            "blocks",
            is_idle(stats)
            and all(p["free"] + p["cached"] + p["in_use"] == p["total"] for p in pools),
            f"in use: device {pools[0]['in_use']}, CPU {pools[1]['in_use']} "
            f"({'idle' if is_idle(stats) else 'NOT idle'} {time.monotonic() - started:.0f} s in)",
        ),
        check_rss([s.t_s for s in load], [s.rss_mb for s in load], args.rss_growth),
        # Locust's opens match the sessions only under a prefix of our own.
        check_keys(account, opens if args.own_prefix else None, args.users),
    ]
    lags = [s.loop_lag_p99_ms for s in load]
    end = samples[-1]
    figures = {
        "users": args.users,
        "duration": args.duration,
        "turns": summary.get("turns"),
        "turns_by_scenario": turns,
        "requests": summary.get("requests"),
        "failures": summary.get("failures"),
        "tokens": summary.get("completion_tokens"),
        "tokens_per_s": summary.get("tokens_per_s"),
        "server_turns": end.turns,
        "server_tokens": end.tokens,
        "rss_mb_start": load[0].rss_mb if load else math.nan,
        "rss_mb_end": end.rss_mb,
        "open_fds_start": load[0].open_fds if load else math.nan,
        "open_fds_max": max((s.open_fds for s in samples), default=math.nan),
        "open_fds_end": end.open_fds,
        "redis_keys": account.keys,
        "keys_by_kind": account.by_kind,
        "sessions": account.sessions,
        "sessions_with_turns": account.sessions_with_turns,
        "sessions_with_system": account.sessions_with_system,
        "locust_opens": opens,
        "redis_used_mb_end": end.redis_used_mb,
        "blocks_in_use_end": {"device": end.device_in_use, "cpu": end.cpu_in_use},
        "loop_lag_p99_ms_median": statistics.median(lags) if lags else math.nan,
        "loop_lag_p99_ms_max": max(lags, default=math.nan),
        "samples": len(samples),
    }
    return checks, figures


def report(checks: list[Check], figures: dict[str, Any], results: Path, doc: bool) -> int:
    """Print the figures and the checks, write verdict.json; 1 when any check failed."""
    verdict = {"checks": [asdict(c) for c in checks], "figures": figures}
    (results / "verdict.json").write_text(json.dumps(verdict, indent=2) + "\n")
    if doc:
        shutil.copyfile(results / "soak.png", REPO / "docs" / "img" / "soak.png")
    print(f"results in {results}")
    for key, value in figures.items():
        print(f"  {key}: {round(value, 1) if isinstance(value, float) else value}")
    for check in checks:
        print(check.line())
    failed = [c.name for c in checks if c.ok is False]
    print("verdict: " + (f"FAIL ({', '.join(failed)})" if failed else "PASS"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
