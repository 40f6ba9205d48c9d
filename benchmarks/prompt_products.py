"""The int8 products of many input rows (a prompt's prefill, a batch past 16 rows) per weight
type and CPU kernel version, side by side in one run, with their outputs compared bit for bit.

Each weight is [`--n`, `--k`] of random blocks, the input `--rows` random fp32 rows; one
thread. Per type, every version in `--cpu-isa` is timed in turn, `--repeats` times (after one
untimed), so that a neighbour's load falls on all of them alike; reported: the best time, its
GFLOP/s (2 m n k), and the ratio against the first version named. Checked before timing, or
the benchmark fails: each version's rows are the same bits as its own one-row products of them
(a row's output does not depend on the rows beside it), and every version is within 1e-4 of
the first's largest output of it (versions sum a row's terms in their own orders).

    .venv/bin/python -m benchmarks.prompt_products [--cpu-isa vnni amx] [--rows 128]
        [--types Q4_0 Q8_0 Q4_K Q5_K Q6_K] [--n 8192] [--k 2048] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from benchmarks.output import emit
from kernels.cpu import dispatch, ops
from kernels.cpu.dispatch import KernelSet
from kernels.cpu.formats import WeightType, random_blocks

DEFAULT_TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def product_seconds(kernels: KernelSet, weight: Any, x: torch.Tensor) -> float:
    start = time.perf_counter()
    ops.gemv(kernels, weight, x)
    return time.perf_counter() - start


def check_products(
    kind: str, names: list[str], versions: list[KernelSet], weight: Any, x: torch.Tensor
) -> None:
    first = ops.gemv(versions[0], weight, x)
    for name, version in zip(names, versions, strict=True):
        product = ops.gemv(version, weight, x)
        for row in (0, x.shape[0] - 1):
            alone = ops.gemv(version, weight, x[row : row + 1])
            if not torch.equal(product[row : row + 1], alone):
                raise AssertionError(f"{kind} on {name}: row {row} is not its one-row product")
        if (product - first).abs().max() > 1e-4 * first.abs().max():
            raise AssertionError(f"{kind}: {name}'s product is not within 1e-4 of {names[0]}'s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-isa", nargs="+", default=["vnni", "auto"])
    parser.add_argument("--types", nargs="+", default=list(DEFAULT_TYPES))
    parser.add_argument("--rows", type=int, default=128, help="input rows (a prompt's tokens)")
    parser.add_argument("--n", type=int, default=8192, help="weight rows")
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    versions: list[KernelSet] = []
    for isa in args.cpu_isa:
        chosen = dispatch.select(isa, "int8")
        if chosen is None:
            print("the CPU kernels did not build", file=sys.stderr)
            return 1
        versions.append(chosen)
    names = [v.chosen["gemv_q8"] for v in versions]
    rows: list[dict[str, Any]] = []
    for kind in (WeightType[t] for t in args.types):
        gen = torch.Generator().manual_seed(int(kind))
        weight = random_blocks(kind, args.n, args.k, gen)
        x = torch.randn(args.rows, args.k, generator=gen)
        check_products(kind.name, names, versions, weight, x)
        best = [float("inf")] * len(versions)
        for _ in range(args.repeats):
            for i, version in enumerate(versions):
                best[i] = min(best[i], product_seconds(version, weight, x))
        flops = 2 * args.rows * args.n * args.k
        for name, seconds in zip(names, best, strict=True):
            rows.append({"type": kind.name, "isa": name, "ms": seconds * 1e3,
                         "gflops": flops / seconds / 1e9, "ratio": best[0] / seconds})  # fmt: skip
    print(f"prompt_products on {dispatch.cpu_description()}: {args.rows} input rows x "
          f"[{args.n}, {args.k}], one thread, int8 inputs, each row's bits as alone")  # fmt: skip
    print(f"\n| type | version | ms | GFLOP/s | against {names[0]} |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['type']} | {r['isa']} | {r['ms']:.2f} | {r['gflops']:.0f} | "
              f"{r['ratio']:.2f}x |")  # fmt: skip
    emit({"rows_in": args.rows, "n": args.n, "k": args.k, "results": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
