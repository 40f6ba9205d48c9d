"""The sampler alone: one step's picks for a batch of rows of a real vocabulary's width, by
the CPU kernels' one call and by tensor ops, side by side in one run.

Cases: seeded random rows (temperature 1); the same under a grammar that allows 1 id in 16
(a dense mask) and 128 ids (a sparse one); greedy rows; and penalized rows (presence,
frequency and repetition over a prompt and an answer of `--context` tokens). Reported: ms per
step, the median of `--repeats` timed steps after a warm-up.

    .venv/bin/python -m benchmarks.sampler [--rows 32] [--vocab 49152] [--context 1000]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.output import emit
from kernels.cpu import dispatch
from service.engine.params import SamplingParams
from service.engine.sampler import Sampler, SamplingRow
from service.engine.token_counts import TokenCounts


def bitmask(rows: int, vocab: int, allowed: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """[rows, vocab / 32] int32 with row r allowing the ids allowed(r) gives."""
    words = (vocab + 31) // 32
    out = torch.zeros(rows, words * 32, dtype=torch.bool)
    for r in range(rows):
        out[r, allowed(r)] = True
    bits = out.view(rows, words, 32).to(torch.int64) << torch.arange(32)
    return bits.sum(-1).to(torch.int32)  # bit 31 wraps to the sign, as llguidance's


def cases(sampler: Sampler, rows: int, vocab: int, context: int) -> dict[str, list[SamplingRow]]:
    gen = torch.Generator().manual_seed(0)
    dense = bitmask(rows, vocab, lambda r: torch.arange(r % 16, vocab, 16))
    sparse = bitmask(rows, vocab, lambda r: torch.randperm(vocab, generator=gen)[:128])

    def seeded(i: int, **params: float) -> SamplingRow:
        return SamplingRow(
            SamplingParams(temperature=1.0, seed=i, **params),  # type: ignore[arg-type]
            sampler.new_generator(i),
        )

    out = {
        "seeded": [seeded(i) for i in range(rows)],
        "dense grammar": [seeded(i) for i in range(rows)],
        "sparse grammar": [seeded(i) for i in range(rows)],
        "greedy": [SamplingRow(SamplingParams(temperature=0), None) for _ in range(rows)],
        "penalties": [],
    }
    for i in range(rows):
        out["dense grammar"][i].allowed = dense[i]
        out["sparse grammar"][i].allowed = sparse[i]
        tokens = torch.randint(0, vocab, (context,), generator=gen).tolist()
        prompt, answer = tokens[: context * 4 // 5], tokens[context * 4 // 5 :]
        row = seeded(i, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
        row.token_ids, row.num_prompt_tokens = tokens, len(prompt)
        row.counts = TokenCounts(prompt, answer)
        out["penalties"].append(row)
    return out


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as the engine runs it on the CPU (EngineConfig.num_threads)
    kernels = dispatch.select("auto")
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(1)) * 3
    paths = {"tensor ops": Sampler(torch.device("cpu"), 0)}
    if kernels is not None:
        paths[f"cpu kernels ({kernels.describe()})"] = Sampler(torch.device("cpu"), 0, kernels)
    report: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "rows": args.rows,
        "vocab": args.vocab,
        "ms_per_step": {},
    }
    for name, sampler in paths.items():
        figures = {}
        for case, rows in cases(sampler, args.rows, args.vocab, args.context).items():
            step = functools.partial(sampler, logits, rows)
            figures[case] = round(timed(step, args.repeats), 3)
        report["ms_per_step"][name] = figures
        print(name, json.dumps(figures), file=sys.stderr)
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
