"""`make loadtest`: Locust, headless, against a pagechat server that is already running.

    .venv/bin/python -m loadtest.run --url ws://127.0.0.1:8000 --users 64 --spawn-rate 8 \\
        --run-time 3m [--results DIR] [-- any other locust option, e.g. --tags oneshot]

Starts no server: when none answers at --url it says so and exits 2. Writes Locust's CSV
files (`locust_stats.csv`, `locust_failures.csv`, ...) and its HTML report into the results
folder, and the final statistics as JSON (`locust_final.json`), then prints a summary (also
saved as `summary.json`). The exit status is Locust's:
non-zero when any request failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parents[1]
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"
SCENARIOS = ("multiturn", "shared", "returning", "oneshot", "openai", "slow")


@dataclass(slots=True)
class Summary:
    users: int
    run_time: str
    turns: int
    requests: int  # every session and turn request (metric entries are not requests)
    failures: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    itl_p50_ms: float
    itl_p95_ms: float
    completion_tokens: int
    tokens_per_s: float
    cached_share: float  # of all prompt tokens, token-weighted
    swapped_share: float
    recomputed_share: float
    turns_by_scenario: dict[str, int]

    def lines(self) -> list[str]:
        scen = ", ".join(f"{k} {v}" for k, v in self.turns_by_scenario.items())
        return [
            f"users {self.users}, run time {self.run_time}",
            f"requests {self.requests} (turns {self.turns}: {scen}), failures {self.failures}",
            f"time to first token p50 {self.ttft_p50_ms:.0f} ms, p95 {self.ttft_p95_ms:.0f} ms",
            f"inter-token latency p50 {self.itl_p50_ms:.0f} ms, p95 {self.itl_p95_ms:.0f} ms",
            f"tokens generated {self.completion_tokens}, {self.tokens_per_s:.1f} tokens/s",
            f"prompt tokens: cached {self.cached_share:.1%}, swapped in "
            f"{self.swapped_share:.1%}, recomputed {self.recomputed_share:.1%}",
        ]


def http_base(url: str) -> str:
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, "", "", ""))


def server_answers(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(http_base(url) + "/health", timeout=10) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _percentile(histogram: dict[str, int], q: float) -> float:
    """The q-quantile of Locust's response-time histogram ({rounded ms: count})."""
    points = sorted((float(ms), n) for ms, n in histogram.items())
    total = sum(n for _, n in points)
    if total == 0:
        return 0.0
    seen = 0
    for ms, n in points:
        seen += n
        if seen >= q * total:
            return ms
    return points[-1][0]


def summarize(stats_json: Path, *, users: int, run_time: str, elapsed_s: float) -> Summary:
    """The summary from Locust's final statistics (`--json-file`), written after the users
    stopped: unlike the CSV files, it includes turns that ended during the stop timeout."""
    loaded: list[dict[str, Any]] = json.loads(stats_json.read_text())
    entries = {(e["method"], e["name"]): e for e in loaded}

    def entry(kind: str, name: str) -> dict[str, Any]:
        return entries.get((kind, name), {"num_requests": 0, "total_content_length": 0})

    def pct(kind: str, name: str, q: float) -> float:
        return _percentile(entry(kind, name).get("response_times", {}), q)

    requests = sum(e["num_requests"] for (k, _), e in entries.items() if k in ("session", "turn"))
    failures = sum(e["num_failures"] for e in entries.values())
    by_scenario = {s: int(entry("turn", s)["num_requests"]) for s in SCENARIOS}
    completion = sum(int(entry("turn", s)["total_content_length"]) for s in SCENARIOS)
    shares = {
        n: int(entry("share", f"{n} %")["total_content_length"])
        for n in ("cached", "swapped", "recomputed")
    }
    prompt_total = sum(shares.values()) or 1
    return Summary(
        users=users,
        run_time=run_time,
        turns=sum(by_scenario.values()),
        requests=requests,
        failures=failures,
        ttft_p50_ms=pct("ttft", "all", 0.50),
        ttft_p95_ms=pct("ttft", "all", 0.95),
        itl_p50_ms=pct("itl", "all", 0.50),
        itl_p95_ms=pct("itl", "all", 0.95),
        completion_tokens=completion,
        tokens_per_s=completion / elapsed_s if elapsed_s > 0 else 0.0,
        cached_share=shares["cached"] / prompt_total,
        swapped_share=shares["swapped"] / prompt_total,
        recomputed_share=shares["recomputed"] / prompt_total,
        turns_by_scenario=by_scenario,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--url", default="ws://127.0.0.1:8000", help="the server (or the proxy)")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--spawn-rate", type=float, default=2.0, help="users started per second")
    parser.add_argument("--run-time", default="60s", help="Locust syntax: 90s, 3m, 1h")
    parser.add_argument(
        "--results", type=Path, default=None, help="default: results/loadtest-<UTC time>"
    )
    parser.add_argument(
        "--stop-timeout", default="60s", help="seconds turns in flight get at the end"
    )
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    if not server_answers(args.url):
        print(
            f"no pagechat server answers at {http_base(args.url)}/health: start one "
            "(make run) or pass --url",
            file=sys.stderr,
        )
        return 2
    results: Path = args.results or REPO / "results" / time.strftime(
        "loadtest-%Y%m%dT%H%M%SZ", time.gmtime()
    )
    results.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--only-summary",
        "--host",
        args.url,
        "--users",
        str(args.users),
        "--spawn-rate",
        str(args.spawn_rate),
        "--run-time",
        args.run_time,
        "--stop-timeout",
        args.stop_timeout,
        "--csv",
        str(results / "locust"),
        "--html",
        str(results / "report.html"),
        "--json-file",
        str(results / "locust_final"),
        *extra,
    ]
    print("running:", " ".join(command), file=sys.stderr)
    started = time.monotonic()
    with (results / "locust.log").open("wb") as log:
        status = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    elapsed = time.monotonic() - started
    stats_json = results / "locust_final.json"
    if not stats_json.exists():
        print(f"Locust wrote no statistics (exit {status}); see {results / 'locust.log'}")
        return status or 1
    # Tokens/s over Locust's whole wall time (start-up and the end's stop timeout included):
    # the tokens of turns finishing during the stop timeout are counted too.
    summary = summarize(stats_json, users=args.users, run_time=args.run_time, elapsed_s=elapsed)
    (results / "summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    print(f"results in {results}")
    for line in summary.lines():
        print("  " + line)
    return status


if __name__ == "__main__":
    sys.exit(main())
