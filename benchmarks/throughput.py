"""Engine throughput with the real model: paged vs contiguous KV allocation, same trace and budget.

The chat trace of `benchmarks/workload.py` (shorter answers, so a run takes a minute or two on
the CPU) is replayed through `LLMEngine` on the default model, once per configuration, with
the same number of device KV blocks for both allocators. Arrivals: `burst` (every first turn
at once, follow-ups as soon as their parent ends) or `rate` (first turns at `--rate`
conversations/s, follow-ups after the user's think time). A follow-up's prompt is the previous
turn's prompt and the answer the model actually gave, plus the new message.

Reported per run: generated tokens/s and requests/s over the run's wall time, the mean
decode batch (sequences that produced a token, per step), request latency p50/p99 (from the
turn being due to its last token), time to first token p50, prompt tokens computed vs found in
the prefix cache, preemptions, and the engine's own time split (`StepTiming`): where the time
goes when one allocator is slower.

    .venv/bin/python -m benchmarks.throughput [--conversations 28] [--blocks 256]
        [--budgets 512 1024] [--rate 1.0] [--json results/throughput.json]

--synthetic SHAPE runs a random-weight model of that shape (benchmarks/synthetic.py) built on
the device instead of the bundled one: the same trace, schedules and budgets, timings of a
model whose answers mean nothing. --burst-only keeps the paged and contiguous burst runs (at
--blocks and each of --budgets), as a short GPU run does. On CUDA each forward is followed by
a device sync, so the time split counts the device's work as forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_step import SyncedForward
from benchmarks.workload import Arrivals, Request, WorkloadConfig, generate
from service.engine.config import AllocationMode, EngineConfig
from service.engine.engine import LLMEngine
from service.engine.loader import LoadedModel, load_model
from service.engine.params import SamplingParams
from service.engine.plan import plan_engine


@dataclass(slots=True, frozen=True)
class RunSpec:
    allocation: AllocationMode
    num_device_blocks: int
    burst: bool = True
    prefix_caching: bool = True

    @property
    def label(self) -> str:
        arrivals = "burst" if self.burst else "rate"
        cache = "" if self.prefix_caching else ", no prefix cache"
        return f"{self.allocation.value}, {self.num_device_blocks} blocks, {arrivals}{cache}"


@dataclass(slots=True)
class _Live:
    request: Request
    due: float
    prompt: list[int]
    answer: list[int]  # sample 0's tokens so far
    finished_samples: int = 0
    first_token: float | None = None


def trace_config(conversations: int, seed: int, rate: float, max_model_len: int) -> WorkloadConfig:
    return WorkloadConfig(
        seed=seed,
        num_conversations=conversations,
        rate=rate,
        answer_median=24.0,
        answer_max=96,
        think_mean_s=2.0,
        max_model_len=max_model_len,
    )


def _params(request: Request) -> SamplingParams:
    # Greedy for one sample; n > 1 samples need randomness to differ.
    temperature = 0.0 if request.n == 1 else 1.0
    return SamplingParams(
        max_tokens=request.output_len,
        temperature=temperature,
        seed=request.conversation,
        n=request.n,
        ignore_eos=True,
    )


def run_one(
    loaded: LoadedModel, config: WorkloadConfig, spec: RunSpec, max_model_len: int
) -> dict[str, Any]:
    trace = generate(config)
    engine = LLMEngine(
        EngineConfig(
            num_device_blocks=spec.num_device_blocks,
            num_cpu_blocks=spec.num_device_blocks,
            max_model_len=max_model_len,
            allocation=spec.allocation,
            enable_prefix_caching=spec.prefix_caching,
        ),
        loaded=loaded,
    )
    if engine.runner.device.type == "cuda":
        engine.step_runner = SyncedForward(engine.step_runner, engine.runner.device)
    arrivals = Arrivals(trace, burst=spec.burst)
    live: dict[str, _Live] = {}
    latencies: list[float] = []
    ttfts: list[float] = []
    batch_sizes: list[int] = []
    generated = 0
    start = time.perf_counter()
    while not arrivals.done:
        now = time.perf_counter() - start
        for r in arrivals.due(now):
            prompt = arrivals.prompt(r)
            live[r.request_id] = _Live(r, now, prompt, [])
            engine.add_request(r.request_id, prompt, _params(r))
        if not engine.has_unfinished_requests():
            next_due = arrivals.next_due()
            assert next_due is not None, "nothing running and nothing due"
            time.sleep(max(0.0, next_due - (time.perf_counter() - start)))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        batch_sizes.append(len(outputs))
        generated += len(outputs)
        for out in outputs:
            entry = live[out.request_id]
            if entry.first_token is None:
                entry.first_token = now
                ttfts.append(now - entry.due)
            if out.index == 0:
                entry.answer.extend(out.new_token_ids)
            if out.finished:
                entry.finished_samples += 1
                if entry.finished_samples == entry.request.n:
                    del live[out.request_id]
                    latencies.append(now - entry.due)
                    arrivals.finish(entry.request, now, [*entry.prompt, *entry.answer])
    elapsed = time.perf_counter() - start
    engine.check_balanced()
    stats = engine.stats()
    timing = stats.timing
    return {
        "label": spec.label,
        "allocation": spec.allocation.value,
        "num_device_blocks": spec.num_device_blocks,
        "burst": spec.burst,
        "prefix_caching": spec.prefix_caching,
        "requests": len(trace.requests),
        "elapsed_s": elapsed,
        "generated_tokens": generated,
        "tokens_per_s": generated / elapsed,
        "requests_per_s": len(trace.requests) / elapsed,
        "mean_batch": statistics.fmean(batch_sizes),
        "steps": stats.steps,
        "latency_p50_s": _percentile(latencies, 50),
        "latency_p99_s": _percentile(latencies, 99),
        "ttft_p50_s": _percentile(ttfts, 50),
        "prompt_tokens_computed": stats.prompt_tokens_computed,
        "prefix_hit_tokens": stats.blocks.prefix_hits + stats.blocks.prefix_cpu_hits,
        "preemptions": stats.preemptions_swap + stats.preemptions_recompute,
        "timing_s": {
            "schedule": timing.schedule,
            "prepare": timing.prepare,
            "forward": timing.forward,
            "sample": timing.sample,
            "postprocess": timing.postprocess,
        },
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))
    return ordered[index]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=28)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=256, help="KV budget of the main runs")
    parser.add_argument("--budgets", type=int, nargs="*", default=[512, 1024])
    parser.add_argument("--rate", type=float, default=1.0, help="conversations/s (rate runs)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", type=Path, default=Path("results/throughput.json"))
    parser.add_argument("--synthetic", metavar="SHAPE", help="a random-weight model of this shape")
    parser.add_argument("--burst-only", action="store_true", help="paged and contiguous bursts")
    args = parser.parse_args()

    probe = EngineConfig(dtype=args.dtype)
    plan = plan_engine(probe)
    if args.synthetic:
        from benchmarks.synthetic import build

        loaded = build(args.synthetic, device=plan.device, dtype=plan.activation_dtype)
    else:
        loaded = load_model(
            None, dtype=plan.activation_dtype, device=plan.device, weight_dtype=plan.weight_dtype
        )
    config = trace_config(args.conversations, args.seed, args.rate, args.max_model_len)
    paged, contiguous = AllocationMode.PAGED, AllocationMode.CONTIGUOUS
    specs = [RunSpec(paged, args.blocks), RunSpec(contiguous, args.blocks)]
    if not args.burst_only:
        specs += [
            RunSpec(paged, args.blocks, prefix_caching=False),
            RunSpec(paged, args.blocks, burst=False),
            RunSpec(contiguous, args.blocks, burst=False),
        ]
    specs += [RunSpec(a, b) for b in args.budgets for a in (paged, contiguous)]
    rows = []
    for spec in specs:
        row = run_one(loaded, config, spec, args.max_model_len)
        rows.append(row)
        print(
            f"{row['label']}: {row['tokens_per_s']:.1f} tok/s, {row['requests_per_s']:.2f} req/s, "
            f"batch {row['mean_batch']:.1f}, p50 {row['latency_p50_s']:.1f} s, "
            f"p99 {row['latency_p99_s']:.1f} s, {row['elapsed_s']:.0f} s",
            flush=True,
        )
    result = {
        "model": loaded.model_id,
        "device": str(plan.device),
        "random_weights": bool(args.synthetic),
        "dtype": str(loaded.model.activation_dtype),
        # Synthetic models hold every weight in the activations' dtype.
        "weight_dtype": str(loaded.model.activation_dtype if args.synthetic else plan.weight_dtype),
        "threads": torch.get_num_threads(),
        "block_size": probe.block_size,
        "max_model_len": args.max_model_len,
        "conversations": args.conversations,
        "rate": args.rate,
        "runs": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
