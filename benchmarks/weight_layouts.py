"""One batch-1 product with int8 inputs per weight type, its rows as stored and regrouped eight
at a time (kernels/cpu/src/rows_x8.h), side by side in one run, against the machine's read
bandwidth.

Each weight is `--mib` of random blocks (past the last-level cache, so it streams from memory),
[n, `--k`]; one input row. Per type and kernel version: GB/s of weight bytes read a product,
the best of `--repeats` (after one untimed), stored and regrouped taken in turn; and the read
bandwidth of torch's `sum` over 1 GiB (or the weight's size, if more) on one thread (best of
five). One thread: the decode stack's threads split these rows, so a thread's rate is what
each of them brings.

    .venv/bin/python -m benchmarks.weight_layouts [--cpu-isa auto avx2 generic] [--mib 128]
        [--types Q4_0 Q8_0 Q4_K Q5_K Q6_K] [--json results/weight_layouts.json]
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
from kernels.cpu.formats import REGROUPED, Blocks, WeightType, random_blocks, row_bytes


def read_bandwidth(nbytes: int) -> float:
    """GB/s torch's `sum` reads `nbytes` of fp32 at, one thread (best of five)."""
    x = torch.ones(nbytes // 4)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(before)
    return nbytes / best / 1e9


def product_rate(kernels: KernelSet, weight: Blocks, x: torch.Tensor) -> float:
    """GB/s of weight bytes one product reads (its best time)."""
    start = time.perf_counter()
    ops.gemv(kernels, weight, x)
    return weight.nbytes / (time.perf_counter() - start) / 1e9


def measure(kernels: KernelSet, kind: WeightType, mib: int, k: int, repeats: int) -> dict[str, Any]:
    n = (mib << 20) // row_bytes(kind, k) // 8 * 8
    gen = torch.Generator().manual_seed(int(kind))
    stored = random_blocks(kind, n, k, gen)
    regrouped = ops.regroup_rows_x8(kernels, Blocks(kind, stored.data.clone(), k))
    x = torch.randn(1, k, generator=gen)
    if not torch.equal(ops.gemv(kernels, stored, x), ops.gemv(kernels, regrouped, x)):
        raise AssertionError(f"{kind.name}: the regrouped rows' product is not the stored one's")
    best = {"stored": 0.0, "regrouped": 0.0}
    for _ in range(repeats):  # in turn, so that a neighbour's load falls on both
        best["stored"] = max(best["stored"], product_rate(kernels, stored, x))
        best["regrouped"] = max(best["regrouped"], product_rate(kernels, regrouped, x))
    return {"type": kind.name, "rows": n, "k": k, "mib": stored.nbytes / 2**20, **best}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-isa", nargs="+", default=["auto"])
    parser.add_argument("--types", nargs="+", default=[t.name for t in REGROUPED])
    parser.add_argument("--mib", type=int, default=128, help="each weight's size")
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    bandwidth = read_bandwidth(max(args.mib, 1024) << 20)  # 1 GiB at least, as engine_step
    rows: list[dict[str, Any]] = []
    for isa in args.cpu_isa:
        chosen = dispatch.select(isa, "int8")
        if chosen is None:
            print("the CPU kernels did not build", file=sys.stderr)
            return 1
        name = chosen.chosen["gemv_q8"]
        for kind in (WeightType[t] for t in args.types):
            row = {"isa": name, **measure(chosen, kind, args.mib, args.k, args.repeats)}
            row["share_of_read"] = row["regrouped"] / bandwidth
            rows.append(row)
    print(f"weight_layouts on {dispatch.cpu_description()}: one input row, one thread; "
          f"torch sum reads {bandwidth:.1f} GB/s")  # fmt: skip
    print("\n| version | type | weight MiB | stored GB/s | regrouped GB/s | ratio | of read |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['isa']} | {r['type']} | {r['mib']:.0f} | {r['stored']:.1f} | "
            f"{r['regrouped']:.1f} | {r['regrouped'] / r['stored']:.2f}x | "
            f"{r['share_of_read']:.0%} |"
        )
    emit({"read_bandwidth_gbs": bandwidth, "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
