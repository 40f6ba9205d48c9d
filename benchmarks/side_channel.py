"""Does the prefix cache tell one session what another sent? A cache-timing side channel.

Published attacks ("The Early Bird Catches the Leak", arXiv 2409.20002; "Auditing Prompt
Caching in Language Model APIs", arXiv 2502.07776) read a shared prefix cache through the
cached-token count and the time to first token. Here, per probe:

  victim    a new session with the shared system prompt sends a secret as its first message
            (first, so that the secret sits where an attacker's first message sits);
  attacker  a new session with the same system prompt sends its first message: the victim's
            secret (a should-hit probe) or fresh random text of as many words from the same
            one-token words (a miss), hits and misses in random order, `max_tokens` 1.

With `--target system-prefix` the secret is in the victim's system prompt (the shared prompt,
then the secret's words), and the attacker opens its session with a system prompt that only
begins like it: the shared prompt and the first half of the secret's words (a hit) or of fresh
words (a miss), then fresh words of its own. Sessions share cached blocks only for the very same
whole system prompt, so neither kind should find more than the other.

Between the two the server is let go idle (its background caching of the victim's turn done),
so both kinds of probe meet the same server. The attacker records `usage.cached_tokens` and
`timing.ttft_s`. Reported, hits against misses: mean cached tokens, TTFT median and p90, the
Mann-Whitney U and Kolmogorov-Smirnov two-sample tests on TTFT, and the attacker's accuracy
when it calls a probe a hit below a TTFT threshold: the best threshold on all probes
(in-sample, optimistic: about 0.55 with no signal at 200 probes) and a threshold fitted on
half the probes and scored on the other half (held-out; 0.5 means no leak).

    .venv/bin/python -m benchmarks.side_channel                # spawns a server: bundled model
    .venv/bin/python -m benchmarks.side_channel --compare      # global sharing, then the default
    .venv/bin/python -m benchmarks.side_channel --compare --target system-prefix
    .venv/bin/python -m benchmarks.side_channel --url ws://127.0.0.1:8000/v1/chat
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.serve import Server, get_stats, http_base, percentile
from clients.chat_client import Answer, ChatClient

SYSTEM = "You are a helpful assistant for the staff of a small clinic. Answer briefly."
# Common English words, each one token after a space in the SmolLM2 vocabulary, so that two
# texts of as many words are as many tokens (the report shows the prompt lengths to check).
_WORDS = [
    "the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "at", "by", "from", "this",
    "that", "have", "are", "was", "will", "can", "not", "all", "one", "two", "new", "time",
    "year", "day", "way", "man", "work", "life", "home", "world", "hand", "part", "place",
    "case", "week", "company", "system", "program", "question", "government", "number", "night",
    "point", "water", "room", "mother", "area", "money", "story", "fact", "month", "lot",
    "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind", "head",
    "house", "service", "friend", "father", "power", "hour", "game", "line", "end", "member",
    "law", "car", "city", "name", "team",
]  # fmt: skip


# ---------------------------------------------------------------------- statistics


@dataclass(frozen=True, slots=True)
class TwoSampleTest:
    statistic: float
    p_value: float


def mann_whitney_u(x: list[float], y: list[float]) -> TwoSampleTest:
    """Two-sided Mann-Whitney U test: U of `x`, and the p-value of the normal approximation
    with tie correction and continuity correction (scipy's `method="asymptotic"`)."""
    n1, n2 = len(x), len(y)
    if not n1 or not n2:
        raise ValueError("both samples must be non-empty")
    pooled = sorted([(v, 0) for v in x] + [(v, 1) for v in y])
    ranks_x = 0.0
    tie_term = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j < len(pooled) and pooled[j][0] == pooled[i][0]:
            j += 1
        rank = (i + 1 + j) / 2  # the average of ranks i+1..j
        ranks_x += rank * sum(1 for k in range(i, j) if pooled[k][1] == 0)
        tie_term += (j - i) ** 3 - (j - i)
        i = j
    n = n1 + n2
    u = ranks_x - n1 * (n1 + 1) / 2
    mean = n1 * n2 / 2
    variance = n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1)))
    if variance <= 0:  # every value equal
        return TwoSampleTest(u, 1.0)
    z = max(0.0, abs(u - mean) - 0.5) / math.sqrt(variance)
    return TwoSampleTest(u, min(1.0, math.erfc(z / math.sqrt(2))))


def kolmogorov_smirnov(x: list[float], y: list[float]) -> TwoSampleTest:
    """Two-sample KS test: D = max |F_x - F_y|, and the asymptotic p-value
    Q_KS((sqrt(ne) + 0.12 + 0.11 / sqrt(ne)) * D), ne = n1 n2 / (n1 + n2) (Numerical Recipes)."""
    if not x or not y:
        raise ValueError("both samples must be non-empty")
    xs, ys = sorted(x), sorted(y)
    d = max(
        abs(bisect.bisect_right(xs, v) / len(xs) - bisect.bisect_right(ys, v) / len(ys))
        for v in xs + ys
    )
    ne = len(xs) * len(ys) / (len(xs) + len(ys))
    lam = (math.sqrt(ne) + 0.12 + 0.11 / math.sqrt(ne)) * d
    return TwoSampleTest(d, kolmogorov_q(lam))


def kolmogorov_q(lam: float) -> float:
    """Q_KS(lam) = P(K > lam), K Kolmogorov-distributed: the p-value of a scaled D."""
    if lam < 0.2:  # the series converges slowly there, to 1
        return 1.0
    total = sum((1 if k % 2 else -1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return min(1.0, max(0.0, 2 * total))


def accuracy_at(hits: list[float], misses: list[float], threshold: float) -> float:
    """The share of probes classified right when `value <= threshold` is called a hit."""
    right = sum(v <= threshold for v in hits) + sum(v > threshold for v in misses)
    return right / (len(hits) + len(misses))


def best_threshold(hits: list[float], misses: list[float]) -> tuple[float, float]:
    """The threshold (a hit is `value <= threshold`) that classifies these probes best, and its
    accuracy. The threshold lies halfway to the next larger value, for probes not seen yet;
    -inf (call nothing a hit) when no threshold beats that."""
    hs, ms = sorted(hits), sorted(misses)
    n = len(hs) + len(ms)
    values = sorted(set(hs + ms))
    best = (-math.inf, len(ms) / n)
    for i, t in enumerate(values):
        right = bisect.bisect_right(hs, t) + len(ms) - bisect.bisect_right(ms, t)
        if right / n > best[1]:
            best = ((t + values[i + 1]) / 2 if i + 1 < len(values) else t, right / n)
    return best


def held_out_accuracy(hits: list[float], misses: list[float]) -> float:
    """Two-fold: fit the threshold on the even-indexed probes of each kind, score it on the
    odd ones, and the other way round; the mean of the two scores."""
    scores = []
    for fit, score in ((0, 1), (1, 0)):
        t, _ = best_threshold(hits[fit::2], misses[fit::2])
        scores.append(accuracy_at(hits[score::2], misses[score::2], t))
    return statistics.fmean(scores)


# ---------------------------------------------------------------------- probing


@dataclass(slots=True)
class Probe:
    hit: bool  # the probe was a victim's secret
    prompt_tokens: int
    cached_tokens: int
    swapped_in_tokens: int
    ttft_s: float  # server-side: message received -> first token


@dataclass(slots=True)
class Report:
    label: str
    server_args: list[str]
    probes: int
    prompt_tokens_hit: float
    prompt_tokens_miss: float
    cached_tokens_hit: float
    cached_tokens_miss: float
    ttft_p50_hit_ms: float
    ttft_p50_miss_ms: float
    ttft_p90_hit_ms: float
    ttft_p90_miss_ms: float
    mann_whitney_u: float
    mann_whitney_p: float
    ks_d: float
    ks_p: float
    ttft_accuracy_in_sample: float
    ttft_accuracy_held_out: float
    cached_tokens_accuracy: float  # best threshold on cached tokens (more cached: a hit)


def random_text(rng: random.Random, num_words: int) -> str:
    return "Note:" + "".join(f" {rng.choice(_WORDS)}" for _ in range(num_words)) + "."


async def first_turn(url: str, system: str, text: str) -> Answer:
    async with await ChatClient.connect(url) as chat:
        await chat.open(system=system)
        return await chat.ask(text, max_tokens=1, temperature=0.0)


async def wait_idle(http: str, timeout_s: float = 10.0) -> None:
    """Until nothing is queued, running or answering (the background caching included)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = await asyncio.to_thread(get_stats, http, 1.0)
        queue = stats["queue"]
        if queue["waiting"] == queue["running"] == queue["swapped"] == 0 == queue["inflight_turns"]:
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"the server did not go idle in {timeout_s}s")


async def probe_all(
    url: str, num_probes: int, secret_words: int, seed: int, target: str = "message"
) -> list[Probe]:
    rng = random.Random(seed)
    kinds = [True] * (num_probes // 2) + [False] * (num_probes - num_probes // 2)
    rng.shuffle(kinds)
    http = http_base(url)
    if target == "message":
        for _ in range(3):  # warm up; the system prompt's blocks are cached from here on
            await first_turn(url, SYSTEM, random_text(rng, secret_words))
    probes = []
    for is_hit in kinds:
        victim, attacker = probe_turns(target, rng, secret_words, is_hit)
        await first_turn(url, *victim)
        await wait_idle(http)
        answer = await first_turn(url, *attacker)
        usage, ttft = answer.usage, answer.timing.ttft_s
        assert ttft is not None, "a one-token answer has a first token"
        probes.append(
            Probe(is_hit, usage.prompt_tokens, usage.cached_tokens, usage.swapped_in_tokens, ttft)
        )
    return probes


def probe_turns(
    target: str, rng: random.Random, secret_words: int, is_hit: bool
) -> tuple[tuple[str, str], tuple[str, str]]:
    """The victim's and the attacker's first turns, (system prompt, message) each. `message`:
    the secret is the victim's message, the attacker sends it (a hit) or fresh text.
    `system-prefix`: the secret ends the victim's system prompt; the attacker's shares its
    first half (a hit) or not (a miss), then goes on with words of its own."""
    secret = random_text(rng, secret_words)
    if target == "message":
        probe = secret if is_hit else random_text(rng, secret_words)
        return (SYSTEM, secret), (SYSTEM, probe)
    half = secret_words // 2
    start = secret if is_hit else random_text(rng, secret_words)
    own = " ".join(start.split()[: half + 1]) + random_text(rng, secret_words - half)[5:]
    return (f"{SYSTEM} {secret}", "Hello."), (f"{SYSTEM} {own}", "Hello.")


def report(label: str, server_args: list[str], probes: list[Probe]) -> Report:
    hits = [p for p in probes if p.hit]
    misses = [p for p in probes if not p.hit]
    if not hits or not misses:
        raise ValueError("need at least one probe of each kind (--probes >= 2)")
    th, tm = [p.ttft_s for p in hits], [p.ttft_s for p in misses]
    mwu, ks = mann_whitney_u(th, tm), kolmogorov_smirnov(th, tm)
    _, cached_acc = best_threshold(
        [-float(p.cached_tokens) for p in hits], [-float(p.cached_tokens) for p in misses]
    )
    return Report(
        label=label,
        server_args=server_args,
        probes=len(probes),
        prompt_tokens_hit=statistics.fmean(p.prompt_tokens for p in hits),
        prompt_tokens_miss=statistics.fmean(p.prompt_tokens for p in misses),
        cached_tokens_hit=statistics.fmean(p.cached_tokens for p in hits),
        cached_tokens_miss=statistics.fmean(p.cached_tokens for p in misses),
        ttft_p50_hit_ms=statistics.median(th) * 1e3,
        ttft_p50_miss_ms=statistics.median(tm) * 1e3,
        ttft_p90_hit_ms=percentile(th, 0.9) * 1e3,
        ttft_p90_miss_ms=percentile(tm, 0.9) * 1e3,
        mann_whitney_u=mwu.statistic,
        mann_whitney_p=mwu.p_value,
        ks_d=ks.statistic,
        ks_p=ks.p_value,
        ttft_accuracy_in_sample=best_threshold(th, tm)[1],
        ttft_accuracy_held_out=held_out_accuracy(th, tm),
        cached_tokens_accuracy=cached_acc,
    )


def print_reports(reports: list[Report]) -> None:
    print(
        "| server | probes | prompt tokens hit/miss | cached tokens hit/miss | "
        "TTFT p50 hit/miss | TTFT p90 hit/miss | Mann-Whitney p | KS D (p) | "
        "TTFT accuracy in-sample/held-out | cached-tokens accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in reports:
        print(
            f"| {r.label} | {r.probes} | {r.prompt_tokens_hit:.1f} / {r.prompt_tokens_miss:.1f} | "
            f"{r.cached_tokens_hit:.1f} / {r.cached_tokens_miss:.1f} | "
            f"{r.ttft_p50_hit_ms:.1f} / {r.ttft_p50_miss_ms:.1f} ms | "
            f"{r.ttft_p90_hit_ms:.1f} / {r.ttft_p90_miss_ms:.1f} ms | "
            f"{r.mann_whitney_p:.2g} | {r.ks_d:.2f} ({r.ks_p:.2g}) | "
            f"{r.ttft_accuracy_in_sample:.2f} / {r.ttft_accuracy_held_out:.2f} | "
            f"{r.cached_tokens_accuracy:.2f} |"
        )


# ---------------------------------------------------------------------- main


def measure(args: argparse.Namespace, label: str, extra: list[str]) -> Report:
    """Probe a server started with the common arguments plus `extra`, or the one at --url."""
    if args.url:
        probes = asyncio.run(
            probe_all(args.url, args.probes, args.secret_words, args.seed, args.target)
        )
        return report(label, [], probes)
    with tempfile.TemporaryDirectory() as tmp:
        server_args = [
            *("--data-dir", f"{tmp}/data", "--dtype", args.dtype),
            *(("--model", args.model) if args.model else ()),
            *shlex.split(args.server_args),
            *extra,
        ]
        server = Server(Path(tmp) / "server.log", server_args)
        try:
            probes = asyncio.run(
                probe_all(server.ws, args.probes, args.secret_words, args.seed, args.target)
            )
        finally:
            code = server.stop()
        if code != 0:
            raise RuntimeError(f"the server stopped with {code}:\n{server.log.read_text()}")
    return report(label, server_args[2:], probes)


def main(argv: list[str] | None = None) -> list[Report]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server's ws://.../v1/chat (default: spawn one)")
    parser.add_argument("--probes", type=int, default=200, help="half hits, half misses")
    parser.add_argument("--secret-words", type=int, default=96, help="words per secret")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="for spawned servers (default: the bundled model)")
    parser.add_argument("--dtype", default="auto", help="for spawned servers")
    parser.add_argument("--server-args", default="", help="more arguments for spawned servers")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="two spawned servers: --global-args (sharing across sessions), then the default",
    )
    parser.add_argument("--global-args", default="--prefix-cache-scope global")
    parser.add_argument(
        "--target",
        choices=["message", "system-prefix"],
        default="message",
        help="the secret in the victim's first message, or in its system prompt",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.probes < 2:
        parser.error("--probes must be >= 2")
    if args.compare and args.url:
        parser.error("--compare starts its own servers; it takes no --url")
    if args.compare:
        runs = [("global", shlex.split(args.global_args)), ("default", [])]
    else:
        runs = [(args.url or "spawned", [])]
    reports = []
    for label, extra in runs:
        reports.append(measure(args, label, extra))
        print(f"{label}: {reports[-1]}", file=sys.stderr)
    print_reports(reports)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=2) + "\n")
    return reports


if __name__ == "__main__":
    main()
