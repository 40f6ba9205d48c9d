"""Decode throughput with a JSON Schema on every request against none, side by side, and what a
schema costs to compile.

One engine on the default model. For each batch size N: N requests with distinct prompts are
prefilled, then `--steps` decode steps are timed with all N in the batch; once with a schema on
every request (each its own: an array of 40 to 60 items of a generated value schema, from
benchmarks/json_schemas.py, under a property of its own, so no answer can end inside the timed
steps and no two masks are one), once free (ignore_eos, so that it too runs every step). The
two runs alternate `--repeats` times and the best of each is kept, so a neighbour's load on a
shared machine falls on both alike. Reported: generated tokens/s of each, their ratio, the
engine's phases per step (`StepTiming`: `grammar` is the wait for masks after the forward),
and compile times. The forward is the same work in both runs, yet on a shared machine its
time moves by 10-20% between runs, more than the masks cost at 32 streams: `ratio_same_forward`
puts both runs' forwards at their mean, which leaves what the schema itself costs.

    .venv/bin/python -m benchmarks.structured_throughput [--batch 1 8 32] [--steps 24]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.json_schemas import value_schema
from benchmarks.output import emit
from service.engine.config import EngineConfig
from service.engine.engine import LLMEngine
from service.engine.params import SamplingParams, StructuredOutput


def schema_for(i: int) -> dict[str, Any]:
    rng = random.Random(i)
    return {
        "type": "object",
        "properties": {
            f"items_{i}": {
                "type": "array",
                "items": value_schema(rng, 3),
                "minItems": 40,
                "maxItems": 60,
            }
        },
        "required": [f"items_{i}"],
        "additionalProperties": False,
    }


def timed_decode(
    engine: LLMEngine, batch: int, steps: int, structured: bool, run: int
) -> dict[str, float]:
    tokenizer = engine.tokenizer
    for i in range(batch):
        question = f"List {i + 3} things about topic number {run * 1000 + i} as JSON."
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}])
        spec = StructuredOutput(kind="json", spec=json.dumps(schema_for(run * 1000 + i)))
        params = SamplingParams(
            temperature=1.0, seed=i, max_tokens=steps + 64, ignore_eos=not structured,
            structured=spec if structured else None,
        )  # fmt: skip
        engine.add_request(f"r{run}-{i}", prompt, params)
    started = 0
    while started < batch:  # prefills (and their first tokens)
        started += sum(1 for out in engine.step() if out.num_output_tokens == 1)
    before = dataclasses.replace(engine.stats().timing)
    tokens = 0
    start = time.perf_counter()
    for _ in range(steps):
        tokens += len(engine.step())
    elapsed = time.perf_counter() - start
    after = engine.stats().timing
    phases = {
        f"{f.name}_ms": 1e3 * (getattr(after, f.name) - getattr(before, f.name)) / steps
        for f in dataclasses.fields(after)
    }
    for i in range(batch):
        engine.abort(f"r{run}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    assert tokens == batch * steps, "an answer ended inside the timed steps"
    return {"tokens_per_s": tokens / elapsed, **phases}


def same_forward_ratio(schema: dict[str, float], free: dict[str, float]) -> float:
    """Throughput with a schema over without, each step's forward taken at the two runs'
    mean: the forward is the same work in both (same batch, same context lengths), so what
    differs is the masks, the sampling and the bookkeeping."""
    forward = (schema["forward_ms"] + free["forward_ms"]) / 2

    def step_ms(phases: dict[str, float]) -> float:
        return sum(v for k, v in phases.items() if k.endswith("_ms") and k != "forward_ms")

    return (forward + step_ms(free)) / (forward + step_ms(schema))


def compile_times(engine: LLMEngine, count: int) -> dict[str, float]:
    from benchmarks.json_schemas import schemas

    start = time.perf_counter()
    grammars = engine.grammars  # the tokenizer's trie, once
    grammars.check(StructuredOutput(kind="json_object"))
    trie_s = time.perf_counter() - start
    times = []
    for schema in schemas(count, seed=99):
        start = time.perf_counter()
        grammars.check(StructuredOutput(kind="json", spec=json.dumps(schema)))
        times.append(time.perf_counter() - start)
    cached = time.perf_counter()
    grammars.check(StructuredOutput(kind="json", spec=json.dumps(schemas(1, seed=99)[0])))
    return {
        "tokenizer_trie_s": round(trie_s, 3),
        "compile_ms_median": round(1e3 * statistics.median(times), 3),
        "compile_ms_max": round(1e3 * max(times), 3),
        "cached_us": round(1e6 * (time.perf_counter() - cached), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    engine = LLMEngine(EngineConfig(max_model_len=1024, kv_cache_mb=256))
    report: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "compile": compile_times(engine, 100),
        "batches": [],
    }
    run = 0
    for batch in args.batch:
        best: dict[bool, dict[str, float]] = {}
        for repeat in range(args.repeats):
            # each kind first in turn: the first run of a pair met a colder cache
            for structured in (True, False) if repeat % 2 == 0 else (False, True):
                run += 1
                got = timed_decode(engine, batch, args.steps, structured, run)
                if structured not in best or got["tokens_per_s"] > best[structured]["tokens_per_s"]:
                    best[structured] = got
        row = {
            "batch": batch,
            "schema_tokens_per_s": round(best[True]["tokens_per_s"], 1),
            "free_tokens_per_s": round(best[False]["tokens_per_s"], 1),
            "ratio": round(best[True]["tokens_per_s"] / best[False]["tokens_per_s"], 3),
            # the same with both runs' forward at their mean: what the schema itself costs
            "ratio_same_forward": round(same_forward_ratio(best[True], best[False]), 3),
            # per step, ms: where the time went, with a schema and without
            "schema_phases": {k: round(v, 3) for k, v in best[True].items() if k.endswith("_ms")},
            "free_phases": {k: round(v, 3) for k, v in best[False].items() if k.endswith("_ms")},
        }
        report["batches"].append(row)
        print(json.dumps(row), file=sys.stderr)
    engine.check_balanced()
    engine.close()
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
