"""Decode throughput of the engine on the default model, per weight format, side by side.

For each batch size, N requests with distinct ~200-token prompts are prefilled, then the engine
runs decode steps with all N sequences in the batch. Reported per batch size and weight format:
aggregate generated tokens/s over the timed decode steps, mean step time, the share of each
step spent in matmuls (every projection and the LM head, timed around each call), and the share
spent outside the model forward (scheduling, block moves and input tensors, sampling,
detokenizing and stop checks). One engine per format, all loaded at once; each batch size runs
every format in turn, so a neighbour's load on a shared machine falls on all of them alike.

    .venv/bin/python -m benchmarks.engine_step [--weights fp32 bf16 int8 int4]
        [--batch 1 4 8 32 64] [--steps 20] [--dtype auto] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from service.engine.config import EngineConfig, dtype_name
from service.engine.engine import LLMEngine, StepTiming
from service.engine.model import Linear, LlamaModel
from service.engine.params import SamplingParams
from service.engine.quant import QuantLinear


class MatmulClock:
    """Seconds spent in the model's matmuls: every projection (hooks around each call) and
    the LM head (`compute_logits`, which is one matmul and a cast). The CPU runs each call
    to completion, so wall time around it is its cost."""

    def __init__(self, model: LlamaModel) -> None:
        self.seconds = 0.0
        self._start = 0.0
        for module in model.modules():
            if isinstance(module, Linear | QuantLinear) and module is not model.lm_head:
                module.register_forward_pre_hook(self._enter)
                module.register_forward_hook(self._leave)
        logits: Callable[[torch.Tensor], torch.Tensor] = model.compute_logits

        def timed_logits(hidden: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out = logits(hidden)
            self.seconds += time.perf_counter() - start
            return out

        model.compute_logits = timed_logits  # type: ignore[method-assign]

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._start = time.perf_counter()

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        self.seconds += time.perf_counter() - self._start


def measure(
    engine: LLMEngine, clock: MatmulClock, batch: int, steps: int, prompt_len: int, seed: int
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
    matmul_before = clock.seconds
    generated = 0
    start = time.perf_counter()
    for _ in range(steps):
        generated += len(engine.step())
    elapsed = time.perf_counter() - start
    matmuls = clock.seconds - matmul_before
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
        "matmul_ms": 1000 * matmuls / steps,
        "matmul_share": matmuls / elapsed,
        "overhead_share": spent.overhead_share,
        "schedule_ms": 1000 * spent.schedule / steps,
        "prepare_ms": 1000 * spent.prepare / steps,
        "forward_ms": 1000 * spent.forward / steps,
        "sample_ms": 1000 * spent.sample / steps,
        "postprocess_ms": 1000 * spent.postprocess / steps,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", nargs="+", default=["fp32", "bf16", "int8", "int4"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 32, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--dtype", default="auto", help="activations and KV cache")
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--kv-cache-mb", type=int, default=2048, help="room for every sequence: no preemption"
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1],
        help="torch thread counts, each format run with each, side by side",
    )
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args()

    engines: dict[str, tuple[LLMEngine, MatmulClock]] = {}
    for weights in args.weights:
        for threads in args.threads:
            config = EngineConfig(
                model=args.model,
                dtype=args.dtype,
                weights=weights,
                max_num_seqs=max(args.batch),
                max_model_len=1024,
                kv_cache_mb=args.kv_cache_mb,
                num_threads=threads,
            )
            engine = LLMEngine(config)  # its crossover trial runs at `threads`
            name = weights if len(args.threads) == 1 else f"{weights} {threads}t"
            engines[name] = (engine, MatmulClock(engine.runner.model))
    rows: dict[str, list[dict[str, float]]] = {w: [] for w in engines}
    for b in args.batch:
        for name, (engine, clock) in engines.items():
            torch.set_num_threads(engine.config.num_threads)
            rows[name].append(measure(engine, clock, b, args.steps, args.prompt_len, seed=b))
    for engine, _ in engines.values():
        engine.check_balanced()

    first = next(iter(engines.values()))[0]
    print(
        f"engine_step: {first.model_id}, {dtype_name(first.activation_dtype)} activations, "
        f"torch threads {' and '.join(map(str, args.threads))}, {args.steps} decode steps, "
        f"~{args.prompt_len}-token prompts"
    )
    for weights, (engine, _) in engines.items():
        print(f"- {weights}: {engine.runner.model.weights_description}")
    names = list(engines)
    print()
    print("| batch | " + " | ".join(f"{w} tokens/s | {w} matmuls" for w in names) + " |")
    print("|---:|" + "---:|---:|" * len(names))
    for i, b in enumerate(args.batch):
        cells = [
            f"{rows[w][i]['tokens_per_s']:.1f} | {100 * rows[w][i]['matmul_share']:.0f}%"
            for w in names
        ]
        print(f"| {b} | " + " | ".join(cells) + " |")
    print()
    print(
        "| weights | batch | tokens/s | step ms | matmul ms | forward ms | outside forward "
        "| sched | prep | sample | post |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in names:
        for r in rows[w]:
            print(
                f"| {w} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['step_ms']:.1f} | "
                f"{r['matmul_ms']:.1f} | {r['forward_ms']:.1f} | "
                f"{100 * r['overhead_share']:.1f}% | {r['schedule_ms']:.2f} | "
                f"{r['prepare_ms']:.2f} | {r['sample_ms']:.2f} | {r['postprocess_ms']:.2f} |"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
