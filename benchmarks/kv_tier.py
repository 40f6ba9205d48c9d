"""The third KV tier (service/engine/kvtier) on this machine, on the default model's real K/V.

For each storage option (raw, int8, zstd, int8-zstd) and each backend (a local directory, a
private redis-server on a Unix socket): bytes per stored token, the tier's write throughput
(encode, checksum, store; the writer thread's time) and read throughput (fetch, check,
decode; the reader thread's time), in MB of K/V (the pool's bytes) per second. Then what each
option does to greedy answers: histories are stored, loaded by a fresh engine, and its
greedy continuation compared token by token with the one recomputed from the token ids
(tests/engine/greedy.py's near-tie rule). Time to first token is `benchmarks/serve.py
resume`'s. Last, Redis memory (INFO used_memory) for N
stored 1,000-token conversations per option.

    .venv/bin/python -m benchmarks.kv_tier --dtype float32 [--histories 4]
        [--redis-conversations 100] [--codecs raw int8 zstd int8-zstd]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import redis
import torch

from benchmarks.serve import RedisServer
from service.engine.config import EngineConfig
from service.engine.engine import LLMEngine
from service.engine.kvtier.config import CODEC_NAMES, KVTierConfig
from service.engine.kvtier.record import BlockLayout
from service.engine.kvtier.redis_backend import RedisBackend
from service.engine.loader import LoadedModel, load_model
from service.engine.params import SamplingParams

_WORDS = ["apple", "river", "stone", "cloud", "seven", "table", "music", "green", "window"]
NEAR_TIE = 1e-3


@dataclass
class CodecResult:
    codec: str
    backend: str
    bytes_per_token: float
    write_mb_s: float  # K/V megabytes (pool bytes) per second of the writer thread
    read_mb_s: float
    blocks: int


@dataclass
class GreedyResult:
    codec: str
    histories: int
    identical: int  # continuations equal token for token to the recomputed one
    near_tie: int  # parted at a near-tie of the recomputed answer's logits
    diverged: int  # parted elsewhere: a real change of the answer
    first_divergence: list[int | None]  # per history, the first differing token's index


def history_ids(engine: LLMEngine, seed: int, words: int) -> list[int]:
    rng = random.Random(seed)
    text = "Remember these words: " + " ".join(rng.choice(_WORDS) for _ in range(words))
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def run(
    engine: LLMEngine, rid: str, ids: list[int], params: SamplingParams, persist: bool = False
) -> tuple[list[int], list[float], float, int]:
    """Tokens, top-2 margins, seconds to the first token, loaded tokens."""
    start = time.perf_counter()
    engine.add_request(rid, ids, params, persist=persist)
    tokens: list[int] = []
    margins: list[float] = []
    first = 0.0
    loaded = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and not tokens:
                first = time.perf_counter() - start
            tokens += out.new_token_ids
            margins += [p[1][1] - p[2][1] for p in out.logprobs or []]
            loaded = out.num_loaded_tokens
    return tokens, margins, first, loaded


def config(args: argparse.Namespace, tier: KVTierConfig | None) -> EngineConfig:
    return EngineConfig(dtype=args.dtype, device="cpu", max_model_len=4096, kv_tier=tier)


def measure_codec(
    args: argparse.Namespace, model: LoadedModel, tier: KVTierConfig, history: list[int]
) -> CodecResult:
    writer = LLMEngine(config(args, tier), loaded=model)
    run(writer, "store", history, SamplingParams(max_tokens=0), persist=True)
    assert writer.kv_tier is not None and writer.kv_tier.flush(600)
    w = writer.kv_tier.stats()
    layout = writer.kv_tier.layout
    writer.close()
    reader = LLMEngine(config(args, tier), loaded=model)
    _, _, _, loaded = run(reader, "load", [*history, 42], SamplingParams(max_tokens=1))
    assert reader.kv_tier is not None
    r = reader.kv_tier.stats()
    reader.close()
    assert loaded == w.blocks_written * layout.block_size, (loaded, w)
    mb = w.blocks_written * layout.raw_bytes / 1e6
    return CodecResult(
        codec=tier.codec,
        backend="dir" if tier.directory is not None else "redis",
        bytes_per_token=w.bytes_written / (w.blocks_written * layout.block_size),
        write_mb_s=mb / w.write_seconds,
        read_mb_s=mb / r.read_seconds,
        blocks=w.blocks_written,
    )


Reference = tuple[list[int], list[int], list[int], list[float]]  # history, turn, tokens, margins


def references(args: argparse.Namespace, model: LoadedModel) -> list[Reference]:
    """Each history, its turn, and the turn's greedy continuation recomputed from the ids
    (deterministic, so one per history serves every storage option)."""
    out = []
    for h in range(args.histories):
        probe = LLMEngine(config(args, None), loaded=model)
        ids = history_ids(probe, 1000 + h, args.history_words)
        turn = [*ids, *probe.tokenizer.encode(" Which word came first?")]
        tokens, margins, _, _ = run(probe, "ref", turn, greedy_params(args))
        probe.close()
        out.append((ids, turn, tokens, margins))
    return out


def greedy_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True, logprobs=2
    )


def measure_greedy(
    args: argparse.Namespace, model: LoadedModel, codec: str, tmp: Path, refs: list[Reference]
) -> GreedyResult:
    result = GreedyResult(codec, len(refs), 0, 0, 0, [])
    tier = KVTierConfig(directory=tmp / f"greedy-{codec}", codec=codec)
    for ids, turn, ref, margins in refs:
        writer = LLMEngine(config(args, tier), loaded=model)
        run(writer, "store", ids, SamplingParams(max_tokens=0), persist=True)
        assert writer.kv_tier is not None and writer.kv_tier.flush(600)
        writer.close()
        reader = LLMEngine(config(args, tier), loaded=model)
        got, _, _, loaded = run(reader, "turn", turn, greedy_params(args))
        reader.close()
        assert loaded > 0
        first = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None)
        result.first_divergence.append(first)
        if first is None:
            result.identical += 1
        elif margins[first] < NEAR_TIE:
            result.near_tie += 1
        else:
            result.diverged += 1
    return result


def redis_memory(layout: BlockLayout, records: list[bytes], conversations: int, url: str) -> int:
    """Bytes of Redis memory (used_memory) that `conversations` copies of `records` take."""
    client = redis.Redis.from_url(url)
    client.flushall()
    before = int(client.info("memory")["used_memory"])
    backend = RedisBackend(url, prefix="kv:", cap_bytes=1 << 40, ttl_s=3600, io_timeout_s=30)
    for c in range(conversations):
        for i, data in enumerate(records):
            backend.put(layout.key(c * 100_000 + i), data)
    after = int(client.info("memory")["used_memory"])
    client.flushall()
    client.close()
    backend.close()
    return after - before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--codecs", nargs="+", default=list(CODEC_NAMES), choices=CODEC_NAMES)
    parser.add_argument("--history-words", type=int, default=960, help="~1,000 tokens")
    parser.add_argument("--histories", type=int, default=4, help="for the greedy comparison")
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--redis-conversations", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model(None, dtype=torch.float32 if args.dtype == "float32" else torch.bfloat16)
    out: dict[str, Any] = {"codecs": [], "greedy": [], "redis_memory": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        server = RedisServer(tmp)
        try:
            probe = LLMEngine(config(args, None), loaded=model)
            history = history_ids(probe, 7, args.history_words)
            probe.close()
            print(f"history: {len(history)} tokens", file=sys.stderr)
            refs = references(args, model)
            for codec in args.codecs:
                for backend in ("dir", "redis"):
                    if backend == "dir":
                        tier = KVTierConfig(directory=tmp / f"tier-{codec}", codec=codec)
                    else:
                        tier = KVTierConfig(
                            redis_url=server.url, redis_prefix=f"{codec}:", codec=codec
                        )
                    result = measure_codec(args, model, tier, history)
                    print(result, file=sys.stderr)
                    out["codecs"].append(asdict(result))
                greedy = measure_greedy(args, model, codec, tmp, refs)
                print(greedy, file=sys.stderr)
                out["greedy"].append(asdict(greedy))
            layout = BlockLayout("m", "m|", model.model.activation_dtype, (30, 2, 16, 3, 64))
            for codec in args.codecs:
                records = sorted((tmp / f"tier-{codec}").rglob("*.kvb"))
                data = [p.read_bytes() for p in records]
                need = sum(map(len, data)) * args.redis_conversations * 1.2
                if need > psutil.virtual_memory().available * 0.7:
                    print(
                        f"redis memory, {codec}: skipped (needs ~{need / 1e9:.1f} GB)",
                        file=sys.stderr,
                    )
                    continue
                used = redis_memory(layout, data, args.redis_conversations, server.url)
                out["redis_memory"][codec] = used
                print(f"redis memory, {codec}: {used / 2**20:.0f} MiB", file=sys.stderr)
        finally:
            server.stop()
    print_tables(out, args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def print_tables(out: dict[str, Any], args: argparse.Namespace) -> None:
    print("| storage | backend | bytes/token | write MB/s | read MB/s |")
    print("|---|---|---:|---:|---:|")
    for r in out["codecs"]:
        print(
            f"| {r['codec']} | {r['backend']} | {r['bytes_per_token']:,.0f} | "
            f"{r['write_mb_s']:.0f} | {r['read_mb_s']:.0f} |"
        )
    print()
    print(
        f"| storage | greedy, {args.answer_tokens} tokens after a loaded history: identical "
        "| parted at a near-tie | parted elsewhere | first divergence |"
    )
    print("|---|---|---|---|---|")
    for g in out["greedy"]:
        print(
            f"| {g['codec']} | {g['identical']} of {g['histories']} | {g['near_tie']} | "
            f"{g['diverged']} | {g['first_divergence']} |"
        )
    print()
    print(
        f"| storage | Redis memory, {args.redis_conversations} conversations | per conversation |"
    )
    print("|---|---:|---:|")
    for codec, used in out["redis_memory"].items():
        each = used / args.redis_conversations / 2**20
        print(f"| {codec} | {used / 2**20:,.0f} MiB | {each:.1f} MiB |")


if __name__ == "__main__":
    sys.exit(main())
