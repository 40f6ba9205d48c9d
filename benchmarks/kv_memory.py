"""KV memory of the allocators on a chat trace: no model, deterministic for a seed.

A trace (`benchmarks/workload.py`) is replayed (`benchmarks/kv_replay.py`) through the real
`Scheduler` and `BlockManager`; each step "computes" what the scheduler picked by advancing
`num_computed_tokens` (full blocks are registered as they are scheduled) and appends the
trace's own answer tokens, so the real admission, growth, prefix-cache, fork/copy-on-write and
preemption logic is what is measured. Every turn is due at once (follow-ups as soon as their
parent ends): a saturated server, where memory is what limits the batch. Allocators, all
under one budget of KV slots:

    paged-{8,16,32}   blocks taken on demand, prefix caching on
    contiguous        max_model_len slots reserved per sequence at admission (block 16)
    oracle            exactly prompt + answer reserved at admission (block 1): no real system
                      can know the answer's length, so this bounds what reservation can do

Reported per allocator: the share of reserved slots holding a token (ratio of time
integrals over steps), the reserved slots that will never hold one (internal fragmentation)
and those reserved for tokens still to come, the peak and mean number of running sequences
(mean over the steps where requests were still waiting: the budget was binding), and
logical vs physical blocks. Then: users sharing one system prompt, and n=4 parallel sampling.

    .venv/bin/python -m benchmarks.kv_memory [--small] [--json results/kv_memory.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.kv_replay import (
    ALLOCATORS,
    CONTIGUOUS,
    PAGED_16,
    Allocator,
    ReplayStats,
    replay,
)
from benchmarks.workload import Request, Trace, WorkloadConfig, generate
from service.engine.config import AllocationMode


def summarize(alloc: Allocator, t: ReplayStats, budget_tokens: int) -> dict[str, Any]:
    return {
        "allocator": alloc.name,
        "block_size": alloc.block_size,
        "budget_tokens": budget_tokens,
        "steps": t.steps,
        "utilization": t.used / t.reserved,
        "internal_fragmentation": t.never_used / t.reserved,
        "reserved_for_later": (t.reserved - t.used - t.never_used) / t.reserved,
        "peak_running": t.peak_running,
        "mean_running_saturated": t.saturated_running / max(1, t.saturated_steps),
        "logical_blocks_mean": t.logical / t.steps,
        "physical_blocks_mean": t.physical / t.steps,
        "preemptions": t.preemptions,
    }


def _one_turn_trace(config: WorkloadConfig, turns: list[tuple[tuple[int, ...], int, int]]) -> Trace:
    """A trace of single-turn requests, all due at once: (prompt, answer length, n)."""
    requests = tuple(
        Request(
            request_id=f"r{i}",
            conversation=i,
            turn=0,
            system_prompt=0,
            new_token_ids=prompt,
            prompt_len=len(prompt),
            output_len=output_len,
            n=n,
            parent=None,
            arrival_s=0.0,
            think_s=0.0,
        )
        for i, (prompt, output_len, n) in enumerate(turns)
    )
    return Trace(config, requests)


def shared_prompt(
    config: WorkloadConfig, users: int, prompt_len: int, block_size: int = 16
) -> dict[str, Any]:
    """`users` one-turn requests: one shared system prompt + a private message each.

    Physical prompt blocks at their peak (every prompt computed, no answer finished yet) with
    prefix caching, against one copy + each user's private blocks, and against no sharing.
    """
    base = generate(replace(config, num_conversations=users, max_turns=1, parallel_prob=0.0))
    system = tuple(range(100, 100 + prompt_len))
    # Answers outlast the admissions (about one prompt per step unshared), so every prompt is
    # held at the peak.
    answer = 64 + 2 * users
    turns = [
        ((*system, *r.new_token_ids[config.system_prompt_len :]), answer, 1) for r in base.requests
    ]
    trace = _one_turn_trace(config, turns)
    budget = sum(len(p) + answer for p, _, _ in turns) + users * block_size
    out: dict[str, Any] = {"users": users, "system_prompt_len": prompt_len}
    for name, caching in (("shared", True), ("unshared", False)):
        alloc = Allocator(name, AllocationMode.PAGED, block_size, prefix_caching=caching)
        t = replay(trace, alloc, budget_tokens=budget, max_model_len=config.max_model_len)
        out[f"{name}_prompt_blocks"] = t.peak_prompt_physical
    shared_full = prompt_len // block_size
    out["ideal_prompt_blocks"] = shared_full + sum(
        -(-len(p) // block_size) - shared_full for p, _, _ in turns
    )
    out["vs_ideal"] = out["shared_prompt_blocks"] / out["ideal_prompt_blocks"]
    out["saved"] = 1 - out["shared_prompt_blocks"] / out["unshared_prompt_blocks"]
    return out


def parallel_sampling(
    config: WorkloadConfig, prompt_len: int = 256, output_len: int = 128, n: int = 4
) -> list[dict[str, Any]]:
    """Peak KV blocks of one request with n samples vs n independent requests (same prompt)."""
    prompt = tuple(range(100, 100 + prompt_len))
    rows = []
    budget = 4 * n * config.max_model_len
    unshared = replace(PAGED_16, name="paged-16, no prefix cache", prefix_caching=False)
    for alloc in (PAGED_16, unshared, CONTIGUOUS):
        for label, turns in (
            (f"n={n}", [(prompt, output_len, n)]),
            (f"{n} requests", [(prompt, output_len, 1)] * n),
        ):
            trace = _one_turn_trace(config, turns)
            t = replay(trace, alloc, budget_tokens=budget, max_model_len=config.max_model_len)
            rows.append({"allocator": alloc.name, "case": label, "peak_blocks": t.peak_physical})
    return rows


def run(config: WorkloadConfig, budget_tokens: int, users: list[int]) -> dict[str, Any]:
    trace = generate(config)
    rows, series = [], {}
    for alloc in ALLOCATORS:
        t = replay(trace, alloc, budget_tokens=budget_tokens, max_model_len=config.max_model_len)
        rows.append(summarize(alloc, t, budget_tokens))
        series[alloc.name] = {"reserved": t.series_reserved, "used": t.series_used}
    return {
        "workload": {
            "seed": config.seed,
            "conversations": config.num_conversations,
            "requests": len(trace.requests),
            "follow_ups": sum(r.parent is not None for r in trace.requests),
            "parallel": sum(r.n > 1 for r in trace.requests),
            "output_tokens": trace.num_output_tokens,
            "max_model_len": config.max_model_len,
            "mean_prompt_len": sum(r.prompt_len for r in trace.requests) / len(trace.requests),
            "mean_output_len": sum(r.output_len for r in trace.requests) / len(trace.requests),
        },
        "allocators": rows,
        "series": series,
        "shared_prompt": [shared_prompt(config, u, 512) for u in users],
        "parallel_sampling": parallel_sampling(config),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the test suite's size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("results/kv_memory.json"))
    args = parser.parse_args()
    result = run_size(args.small, args.seed)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "series"}, indent=1))
    return 0


def run_size(small: bool, seed: int = 0) -> dict[str, Any]:
    if small:
        config = WorkloadConfig(seed=seed, num_conversations=40)
        return run(config, budget_tokens=8192, users=[1, 8, 32])
    config = WorkloadConfig(seed=seed, num_conversations=300)
    return run(config, budget_tokens=32768, users=[1, 2, 4, 8, 16, 32, 64])


if __name__ == "__main__":
    sys.exit(main())
