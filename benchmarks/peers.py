"""pagechat against llama.cpp's llama-server on the same GGUF, same prompts, side by side.

Both servers speak OpenAI's streamed /v1/chat/completions; both get the same requests: ~100-token
chat prompts, distinct per stream and per round (a tag opens the system message, so neither
server's prompt cache can reuse one), greedy, `max_tokens` tokens each with `ignore_eos` (both
servers honour it; every answer's usage must then say exactly `max_tokens`, or the run fails).
At each concurrency N, N streams start together; tokens/s is the completion tokens of all N over
the wall time from the first request sent to the last [DONE], and the time to first token is
each stream's first chunk with text. Every server runs every (round, N) in turn, the order
reversed each round, so a neighbour's load on a shared machine falls on all of them alike.

Servers, all started at once and kept running (each idle while another is measured):
- `pagechat serve` once per `--pagechat` configuration (default: one, its defaults), each on a
  free loopback port with an embedded Redis in a temporary directory;
- llama-server (scripts/build-llama-server.sh; `make llama-server`) on the bundled GGUF,
  `-np 32 -t 2 --no-repack -c <slots x 512>`.
At equal KV capacity: each pagechat gets `--kv-cache-mb` for llama-server's context (`-c`
tokens of K and V in float16, both servers' cache dtype) and no swap pool, unless its
configuration names either option (`--no-equal-kv`: pagechat's own defaults).
Memory: each server's peak RSS from when it listens to its stop, psutil every 0.2 s, and the
kernel's high-water mark of it (VmHWM, start-up included); the children (pagechat's embedded
redis-server) are summed apart, not in the server's figures.

Without a llama-server binary it prints why and exits 0, having run nothing (`SKIPPED`).

    .venv/bin/python -m benchmarks.peers [--pagechat "" --pagechat "--cpu-isa avx2"]
        [--streams 1 8 32] [--rounds 2] [--max-tokens 128] [--json results/peers.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gguf

from benchmarks.peer_servers import DEFAULT_BINARY, LlamaServer, Peak, RssPeaks
from benchmarks.serve import Server
from benchmarks.sse_client import StreamError, StreamResult, stream_chat
from kernels.cpu.dispatch import cpu_description
from service.engine.loader import default_model_path, open_gguf

LLAMA = "llama-server"
BUSY_LOAD = 1.0  # a 1-minute load average above this before the run earns a warning
# Questions the prompts are built from; a stream takes one by its index.
QUESTIONS = (
    "Why is the sky blue during the day and red at sunset?",
    "How does a refrigerator keep food cold?",
    "What causes the seasons on Earth?",
    "How do vaccines teach the immune system to fight a disease?",
    "Why does bread rise when it is baked?",
    "How does a bicycle stay upright while it is moving?",
    "What is the difference between weather and climate?",
    "How do bees make honey?",
    "Why do we have leap years?",
    "How does a compass find north?",
    "What makes a rainbow appear after rain?",
    "How do airplanes stay in the air?",
    "Why does ice float on water?",
    "How did people tell the time before clocks?",
    "What happens inside a volcano before it erupts?",
    "How does the heart pump blood around the body?",
    "Why do cats purr?",
    "How is glass made from sand?",
    "What causes thunder and lightning?",
    "How do plants turn sunlight into food?",
    "Why does the moon change its shape during the month?",
    "How does a steam engine work?",
    "What is the water cycle?",
    "How do birds know where to fly when they migrate?",
    "Why is the ocean salty?",
    "How does a printing press work?",
    "What makes earthquakes happen?",
    "How do submarines dive and come back up?",
    "Why do leaves change colour in autumn?",
    "How does soap clean dirty hands?",
    "What did the first maps of the world look like?",
    "How does a lighthouse help ships at night?",
)
SYSTEM = (
    "You are a patient teacher who explains things to curious adults. Answer in plain, complete "
    "sentences, without lists or headings, and keep to the facts that are well established."
)
USER = (
    "{question} Please explain it step by step, starting from what most people already know, "
    "give one concrete example from everyday life, and end with one common misunderstanding "
    "about it and why it is wrong."
)


def chat_messages(tag: str, index: int) -> list[dict[str, str]]:
    """Stream `index`'s prompt; `tag` (round and concurrency) opens it, so no two requests of
    a run share more than the chat template's first tokens."""
    return [
        {"role": "system", "content": f"Conversation {tag}-{index}. {SYSTEM}"},
        {"role": "user", "content": USER.format(question=QUESTIONS[index % len(QUESTIONS)])},
    ]


def request_body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """Fields both servers take: pagechat refuses unknown ones, llama-server ignores them."""
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


# ---------------------------------------------------------------------- figures


@dataclass(slots=True)
class Measurement:
    """One server, one round, N streams started together."""

    server: str
    round: int
    streams: int
    wall_s: float
    completion_tokens: int  # summed over the streams
    tokens_per_s: float
    ttfts_s: list[float]
    prompt_tokens: list[int]
    loadavg_1m: float


def measure(server: str, rnd: int, results: Sequence[StreamResult], loadavg: float) -> Measurement:
    """Aggregate figures of one concurrent batch of streams."""
    start = min(r.sent_at for r in results)
    end = max(r.done_at or r.sent_at for r in results)
    tokens = sum(r.completion_tokens for r in results)
    return Measurement(
        server=server,
        round=rnd,
        streams=len(results),
        wall_s=end - start,
        completion_tokens=tokens,
        tokens_per_s=tokens / (end - start),
        ttfts_s=[r.ttft_s for r in results],
        prompt_tokens=[r.prompt_tokens for r in results],
        loadavg_1m=loadavg,
    )


def check_counts(server: str, results: Sequence[StreamResult], max_tokens: int) -> None:
    """Every answer must be exactly `max_tokens` long by the server's own usage."""
    counts = [r.completion_tokens for r in results]
    if any(c != max_tokens for c in counts):
        raise StreamError(f"{server}: completion tokens {counts}, expected {max_tokens} each")


@dataclass(slots=True)
class Summary:
    """One server at one concurrency, over all rounds."""

    server: str
    streams: int
    tokens_per_s_rounds: list[float]
    tokens_per_s: float  # mean of the rounds
    ttft_p50_s: float  # over every stream of every round
    ttft_mean_s: float
    prompt_tokens_mean: float
    loadavg_mean: float  # the 1-minute load average after each of its rounds
    tokens_per_s_ratio: float | None = None  # this / llama-server's
    ttft_p50_ratio: float | None = None


def summarize(measurements: Sequence[Measurement], reference: str = LLAMA) -> list[Summary]:
    """Per (streams, server), in order of first appearance, with ratios to `reference`."""
    groups: dict[tuple[int, str], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.streams, m.server), []).append(m)
    out = []
    for (streams, server), ms in sorted(groups.items(), key=lambda kv: kv[0][0]):
        ttfts = [t for m in ms for t in m.ttfts_s]
        out.append(
            Summary(
                server=server,
                streams=streams,
                tokens_per_s_rounds=[m.tokens_per_s for m in ms],
                tokens_per_s=statistics.fmean(m.tokens_per_s for m in ms),
                ttft_p50_s=statistics.median(ttfts),
                ttft_mean_s=statistics.fmean(ttfts),
                prompt_tokens_mean=statistics.fmean(p for m in ms for p in m.prompt_tokens),
                loadavg_mean=statistics.fmean(m.loadavg_1m for m in ms),
            )
        )
    refs = {s.streams: s for s in out if s.server == reference}
    for s in out:
        if (ref := refs.get(s.streams)) is not None:
            s.tokens_per_s_ratio = s.tokens_per_s / ref.tokens_per_s
            s.ttft_p50_ratio = s.ttft_p50_s / ref.ttft_p50_s
    return out


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def markdown(summaries: Sequence[Summary], peaks: dict[str, Peak], model: str = "") -> str:
    """A table per concurrency, each naming the model (`model_summary`), then the memory
    table."""
    lines: list[str] = []
    for streams in sorted({s.streams for s in summaries}):
        on = f" ({model})" if model else ""
        lines += [
            f"{streams} concurrent stream{'s' if streams > 1 else ''}{on}:",
            "",
            "| server | tokens/s by round | tokens/s | TTFT p50 | TTFT mean | prompt tokens "
            "| load avg | tokens/s vs llama-server | TTFT p50 vs llama-server |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for s in (s for s in summaries if s.streams == streams):
            rounds = ", ".join(f"{v:.1f}" for v in s.tokens_per_s_rounds)
            lines.append(
                f"| {s.server} | {rounds} | {s.tokens_per_s:.1f} | {s.ttft_p50_s:.3f} s | "
                f"{s.ttft_mean_s:.3f} s | {s.prompt_tokens_mean:.0f} | {s.loadavg_mean:.1f} | "
                f"{_ratio(s.tokens_per_s_ratio)} | {_ratio(s.ttft_p50_ratio)} |"
            )
        lines.append("")
    lines += [
        "| server | peak RSS (sampled) | high-water mark (VmHWM) | its children's peak RSS |",
        "|---|---:|---:|---:|",
    ]
    for label, p in peaks.items():
        kids = (
            f"{p.children_rss_mb:.0f} MB ({', '.join(sorted(p.children))})"
            if p.children
            else "none"
        )
        lines.append(f"| {label} | {p.rss_mb:.0f} MB | {p.hwm_mb:.0f} MB | {kids} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the run


@dataclass(slots=True)
class Target:
    label: str
    host: str
    port: int


async def run_streams(target: Target, bodies: Sequence[dict[str, Any]]) -> list[StreamResult]:
    return list(await asyncio.gather(*(stream_chat(target.host, target.port, b) for b in bodies)))


async def run_rounds(
    targets: Sequence[Target],
    streams: Sequence[int],
    rounds: int,
    max_tokens: int,
    log: Callable[[str], None],
) -> list[Measurement]:
    """Every (round, N): the same N prompts to every server, in turn; odd rounds reversed."""
    for t in targets:  # a first request per server: lazy set-up is not measured
        warm = await run_streams(t, [request_body(chat_messages("warm-up", 0), 8)])
        check_counts(t.label, warm, 8)
    measurements = []
    for rnd in range(1, rounds + 1):
        order = list(targets) if rnd % 2 else list(reversed(targets))
        for n in streams:
            bodies = [request_body(chat_messages(f"r{rnd}-n{n}", i), max_tokens) for i in range(n)]
            for t in order:
                results = await run_streams(t, bodies)
                check_counts(t.label, results, max_tokens)
                m = measure(t.label, rnd, results, os.getloadavg()[0])
                log(
                    f"round {rnd}, {n} streams, {t.label}: {m.tokens_per_s:.1f} tokens/s, "
                    f"TTFT p50 {statistics.median(m.ttfts_s):.3f} s, load {m.loadavg_1m:.2f}"
                )
                measurements.append(m)
    return measurements


def pagechat_label(args: str) -> str:
    return f"pagechat {args}".strip()


def model_summary(model: Path) -> str:
    """What a table's figures were measured on: the file, its size, parameters and quant
    ("llama-3.2-1b-random-q4_k_m.gguf, 669 MB, 1.07B parameters, Q4_K_M: Q4_K x97, ...")."""
    reader = open_gguf(model)
    field = reader.get_field("general.file_type")
    try:
        quant = gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_")  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        quant = "file type not stated"
    counts = collections.Counter(
        gguf.GGMLQuantizationType(int(t.tensor_type)).name for t in reader.tensors
    )
    parameters = sum(int(t.n_elements) for t in reader.tensors)
    types = ", ".join(f"{name} x{n}" for name, n in counts.most_common())
    return (
        f"{model.name}, {model.stat().st_size / 1e6:.0f} MB, {parameters / 1e9:.2f}B parameters,"
        f" {quant}: {types}"
    )


def kv_bytes_per_token(model: Path) -> int:
    """K and V of one token in float16 over every layer, from the GGUF's shape."""
    reader = open_gguf(model)
    arch = str(reader.get_field("general.architecture").contents())  # type: ignore[union-attr]

    def field(key: str, default: int | None = None) -> int:
        value = reader.get_field(f"{arch}.{key}")
        if value is None:
            if default is None:
                raise ValueError(f"{model.name} has no {arch}.{key}")
            return default
        return int(value.contents())

    heads = field("attention.head_count")
    kv_heads = field("attention.head_count_kv")
    # Gemma's heads are wider than hidden / heads: key_length says so where it differs.
    head_dim = field("attention.key_length", field("embedding_length") // heads)
    return field("block_count") * 2 * kv_heads * head_dim * 2


def equal_kv_options(config: str, context_tokens: int, bytes_per_token: int) -> str:
    """`config` with pagechat's KV pools sized to llama-server's context, where it does not
    size them itself."""
    given = shlex.split(config)
    if any(o in given for o in ("--kv-cache-mb", "--swap-space-mb", "--num-device-blocks")):
        return config
    mib = -(-context_tokens * bytes_per_token // (1 << 20))
    return shlex.join([*given, "--kv-cache-mb", str(mib), "--swap-space-mb", "0"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pagechat",
        action="append",
        default=None,
        metavar="ARGS",
        help="one pagechat configuration: extra `pagechat serve` options in one string, e.g. "
        '"--cpu-isa avx2" ("" for the defaults); repeat to compare several (default: "")',
    )
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_BINARY, help="the binary")
    parser.add_argument(
        "--llama-arg", action="append", default=[], help="extra llama-server option"
    )
    parser.add_argument(
        "--no-equal-kv",
        dest="equal_kv",
        action="store_false",
        help="run pagechat with its own KV pool sizes, not llama-server's context",
    )
    parser.add_argument("--slots", type=int, default=32, help="llama-server -np")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t")
    parser.add_argument("--ctx-per-slot", type=int, default=512, help="llama-server -c / -np")
    parser.add_argument("--model", type=Path, default=None, help="default: the bundled GGUF")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the tables here")
    return parser.parse_args(argv)


@dataclass(slots=True)
class Run:
    measurements: list[Measurement]
    peaks: dict[str, Peak]
    llama_command: list[str]


def run(args: argparse.Namespace, model: Path, configs: list[str]) -> Run:
    """Start every server, measure, stop them (whatever happened)."""
    peaks = RssPeaks()
    peaks.start()
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp, contextlib.ExitStack() as stack:
        stack.callback(peaks.stop)  # last, after every server has stopped
        targets: list[Target] = []
        per_token = kv_bytes_per_token(model)
        for i, extra in enumerate(configs):
            label = pagechat_label(extra)
            if args.equal_kv:
                extra = equal_kv_options(extra, args.slots * args.ctx_per_slot, per_token)
            serve_args = ["--data-dir", f"{tmp}/data-{i}", "--model", str(model)]
            server = Server(Path(tmp) / f"pagechat-{i}.log", [*serve_args, *shlex.split(extra)])
            stack.callback(server.stop)
            peaks.watch(label, server.proc.pid)
            host, port = server.http.removeprefix("http://").split(":")
            targets.append(Target(label, host, int(port)))
        llama = LlamaServer(
            args.llama_server,
            model,
            Path(tmp) / "llama-server.log",
            slots=args.slots,
            threads=args.threads,
            context=args.slots * args.ctx_per_slot,
            extra=args.llama_arg,
        )
        stack.callback(llama.stop)
        peaks.watch(LLAMA, llama.proc.pid)
        targets.append(Target(LLAMA, llama.host, llama.port))
        measurements = asyncio.run(
            run_rounds(
                targets,
                args.streams,
                args.rounds,
                args.max_tokens,
                lambda line: print(line, file=sys.stderr, flush=True),
            )
        )
    return Run(measurements, peaks.peaks, llama.command)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.llama_server.is_file():
        print(
            f"SKIPPED: no llama-server at {args.llama_server}; build it with "
            "`make llama-server` (scripts/build-llama-server.sh, once: 10-20 minutes)",
            file=sys.stderr,
        )
        return 0
    if max(args.streams) > args.slots:
        raise SystemExit(f"--streams up to {max(args.streams)} needs --slots >= that")
    model = args.model or default_model_path()
    configs = args.pagechat if args.pagechat is not None else [""]
    started = datetime.datetime.now(datetime.UTC)
    loadavg_start = os.getloadavg()
    if loadavg_start[0] > BUSY_LOAD:
        print(
            f"WARNING: load average {loadavg_start[0]:.1f} before the run: other processes share "
            "the cores; llama-server's threads wait for each other at every op and suffer most "
            "(docs/perf.md), so read its figures with the load column",
            file=sys.stderr,
        )
    result = run(args, model, configs)
    loadavg_end = os.getloadavg()
    summaries = summarize(result.measurements)
    print(
        f"peers: {model.name}, {len(args.streams)} concurrencies x {args.rounds} rounds, "
        f"{args.max_tokens} tokens a stream; {cpu_description()}, {os.cpu_count()} CPUs; "
        f"{'equal KV capacity' if args.equal_kv else 'own KV pool sizes'}; load average "
        f"{loadavg_start[0]:.2f} at the start, {loadavg_end[0]:.2f} at the end; "
        f"llama-server {shlex.join(result.llama_command[1:])}"
    )
    print()
    table = markdown(summaries, result.peaks, model_summary(model))
    print(table)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "started": started.isoformat(timespec="seconds"),
            "model": str(model),
            "cpu": cpu_description(),
            "equal_kv": args.equal_kv,
            "cpus": os.cpu_count(),
            "loadavg_start": loadavg_start,
            "loadavg_end": loadavg_end,
            "max_tokens": args.max_tokens,
            "pagechat_configs": configs,
            "llama_server_command": result.llama_command,
            "measurements": [asdict(m) for m in result.measurements],
            "summaries": [asdict(s) for s in summaries],
            "peak_rss_mb": {
                k: asdict(p) | {"children": sorted(p.children)} for k, p in result.peaks.items()
            },
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
