"""Decode throughput of the engine on the default model, and what its steps cost outside the model.

For each batch size, N requests with distinct ~200-token prompts are prefilled, then the engine
runs decode steps with all N sequences in the batch. Reported per batch size: aggregate
generated tokens/s over the timed decode steps, mean step time, and the share of each step
spent outside the model forward (scheduling, block moves and input tensors, sampling,
detokenizing and stop checks).

    .venv/bin/python -m benchmarks.engine_step [--batch 1 8 32 64] [--steps 20] [--dtype auto]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch

from service.engine.config import EngineConfig
from service.engine.engine import LLMEngine, StepTiming
from service.engine.params import SamplingParams


def measure(
    engine: LLMEngine, batch: int, steps: int, prompt_len: int, seed: int
) -> dict[str, float]:
    rng = random.Random(seed)
    # Long enough that no sequence finishes while the others are still prefilling.
    params = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(17, 49152) for _ in range(prompt_len)]
        engine.add_request(f"b{batch}-{i}", prompt, params)
    # Prefill everything and take one decode step so the timed steps are pure decode.
    while engine.stats().num_waiting or any(
        s.num_uncomputed_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()
    before = engine.stats().timing
    generated = 0
    start = time.perf_counter()
    for _ in range(steps):
        generated += len(engine.step())
    elapsed = time.perf_counter() - start
    after = engine.stats().timing
    for i in range(batch):
        engine.abort(f"b{batch}-{i}")
    spent = StepTiming(
        **{
            f.name: getattr(after, f.name) - getattr(before, f.name)
            for f in dataclasses.fields(StepTiming)
        }
    )
    return {
        "batch": batch,
        "decoded_per_step": generated / steps,
        "tokens_per_s": generated / elapsed,
        "step_ms": 1000 * elapsed / steps,
        "overhead_share": spent.overhead_share,
        "schedule_ms": 1000 * spent.schedule / steps,
        "prepare_ms": 1000 * spent.prepare / steps,
        "forward_ms": 1000 * spent.forward / steps,
        "sample_ms": 1000 * spent.sample / steps,
        "postprocess_ms": 1000 * spent.postprocess / steps,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--dtype", default="auto", help="activations and KV cache")
    parser.add_argument("--weight-dtype", default="auto", help="matmul weights")
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--kv-cache-mb", type=int, default=2048, help="room for every sequence: no preemption"
    )
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args()

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        max_num_seqs=max(args.batch),
        max_model_len=1024,
        kv_cache_mb=args.kv_cache_mb,
    )
    engine = LLMEngine(config)
    rows = [measure(engine, b, args.steps, args.prompt_len, seed=b) for b in args.batch]
    engine.check_balanced()

    print(
        f"engine_step: {engine.model_id}, {engine.weight_dtype} weights, "
        f"{engine.activation_dtype} activations, "
        f"{torch.get_num_threads()} torch thread(s), {args.steps} decode steps, "
        f"~{args.prompt_len}-token prompts"
    )
    print(
        "| batch | decoded/step | tokens/s | step ms | forward ms | outside forward "
        "| sched | prep | sample | post |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['decoded_per_step']:.1f} | {r['tokens_per_s']:.1f} | "
            f"{r['step_ms']:.1f} | "
            f"{r['forward_ms']:.1f} | {100 * r['overhead_share']:.1f}% | {r['schedule_ms']:.2f} | "
            f"{r['prepare_ms']:.2f} | {r['sample_ms']:.2f} | {r['postprocess_ms']:.2f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
