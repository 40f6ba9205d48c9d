"""Check the Triton kernels against their references at full size, then time them.

On a CUDA device:
  1. correctness: attention (decode, prefill, mixed; bf16, fp16, fp32; variable context
     lengths, shuffled block tables) against `kernels.reference` computed in float64, and the
     cache ops (write_kv, copy_blocks, swap out and in) bit for bit, on fresh random inputs;
  2. timings: decode over batch x context for a large GQA shape and the default SmolLM2
     shape, as device time (CUDA graph replay of up to three input sets in turn, each after
     an L2 flush, so neither a warm cache nor the host's launch cost flatters or hides
     anything; the median of 25 replays) and achieved K/V read bandwidth next
     to the device's measured copy bandwidth, and next to torch SDPA over contiguous K/V
     (whose output is compared too); per-call time with `triton.testing.do_bench` (median,
     L2 flushed between runs), which includes the host's launch cost where that dominates;
     the host cost of plan() and attend(); a mixed prefill+decode batch and a prefill batch
     against the torch reference backend; the cache ops.
With --sweep it then times a grid of launch configurations (tile, warps, pipeline stages,
splits, mask skipping, offset width, register cap, and a head-major cache layout) on the
decode batch of the issue's target, 64 x 4096, and two others, each next to SDPA, so one run
on a borrowed GPU says which to make the default.
Without CUDA it says so and runs the correctness part at small sizes under the interpreter.

    PYTHONPATH=. python3 benchmarks/kernels.py [--out kernels.md] [--quick] [--sweep | --sweep-only]

Imports only torch, triton and the standard library (the GPU image has nothing else).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if TYPE_CHECKING:
    from kernels.attention_launch import LaunchTuning
    from kernels.metadata import AttentionMetadata
    from kernels.triton_backend import TritonBackend

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
GiB = 1 << 30


@dataclass(frozen=True)
class Shape:
    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16


@dataclass(frozen=True)
class Sizes:
    """What the timing part runs."""

    batches: tuple[int, ...] = (1, 16, 64, 256)
    contexts: tuple[int, ...] = (512, 4096, 16384)
    prefill: int = 2048  # prompt / chunk length of the prefill and mixed batches
    mixed_decodes: int = 64
    mixed_context: int = 4096
    cache_layers: int = 32
    cache_blocks: int = 4096
    moved_blocks: int = 256  # per copy_blocks / swap call
    write_tokens: int = 4096
    swap_reps: int = 5
    host_cost_cases: tuple[tuple[int, int], ...] = ((16, 512), (256, 4096))  # batch, ctx


FULL = Sizes()
QUICK = Sizes(batches=(1, 64), contexts=(512, 4096), mixed_decodes=16, swap_reps=3)

LARGE = Shape("32q/8kv/d128", 32, 8, 128)
SMOL = Shape("9q/3kv/d64", 9, 3, 64)


@dataclass
class Paged:
    meta: AttentionMetadata
    pool: torch.Tensor  # [1, 2, N, bs, Hkv, D]
    query: torch.Tensor  # [T, Hq, D]

    @property
    def kv_bytes(self) -> int:  # K and V bytes attention must read
        _, _, _, _, heads, dim = self.pool.shape
        return 2 * sum(self.meta.seq_lens_host) * heads * dim * self.pool.element_size()


class Report:
    """Prints lines and appends them to the markdown file as they come, so a run cut short
    still leaves what it measured."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        self.failures: list[str] = []
        if out is not None:
            out.write_text("")

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        if self.out is not None:
            with self.out.open("a") as f:
                f.write(line + "\n")

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        self.say("| " + " | ".join(header) + " |")
        self.say("|" + "---|" * len(header))
        for row in rows:
            self.say("| " + " | ".join(row) + " |")
        self.say()

    def check(self, what: str, err: float, tol: float) -> str:
        ok = err <= tol  # NaN fails
        if not ok:
            self.failures.append(f"{what}: {err:.2e} > {tol:.0e}")
        return f"{err:.1e} {'ok' if ok else 'FAIL'}"


def build_paged(
    lens: list[tuple[int, int]], shape: Shape, device: torch.device, gen: torch.Generator
) -> Paged:
    """A one-layer pool with shuffled blocks; (query_len, seq_len) per sequence."""
    from kernels.metadata import AttentionMetadata

    bs = shape.block_size
    per_seq = [math.ceil(s / bs) for _, s in lens]
    num_blocks = sum(per_seq) + 1
    # Block 0 pads the tables and stays NaN, like every slot past a sequence's end.
    perm = torch.randperm(num_blocks - 1, generator=gen, device=device).to(torch.int32) + 1
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32, device=device)
    pool = torch.full(
        (1, 2, num_blocks, bs, shape.kv_heads, shape.head_dim),
        math.nan,
        dtype=shape.dtype,
        device=device,
    )
    slots, used = [], 0
    for i, ((q_len, s_len), n) in enumerate(zip(lens, per_seq, strict=True)):
        ids = perm[used : used + n]
        used += n
        tables[i, :n] = ids
        kv = torch.randn(2, s_len, shape.kv_heads, shape.head_dim, generator=gen, device=device).to(
            shape.dtype
        )  # [2, S, Hkv, D]
        flat = pool[0].view(2, num_blocks * bs, shape.kv_heads, shape.head_dim)
        pos = torch.arange(s_len, device=device)
        slot = ids.long()[pos // bs] * bs + pos % bs  # [S]
        flat[:, slot] = kv
        slots.append(slot[s_len - q_len :])
    q_lens, s_lens = [q for q, _ in lens], [s for _, s in lens]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], device=device).int(),
        seq_lens=torch.tensor(s_lens, dtype=torch.int32, device=device),
        block_tables=tables,
        block_size=bs,
        query_lens_host=q_lens,
        seq_lens_host=s_lens,
    )
    query = torch.randn(sum(q_lens), shape.q_heads, shape.head_dim, generator=gen, device=device)
    return Paged(meta=meta, pool=pool, query=query.to(shape.dtype))


def attend(backend: TritonBackend, p: Paged, plan: Any = None) -> torch.Tensor:
    plan = backend.plan(p.meta) if plan is None else plan
    scale = p.query.shape[-1] ** -0.5
    return backend.attend(p.query, p.pool[0, 0], p.pool[0, 1], p.meta, plan, scale)


def reference_attention(p: Paged) -> torch.Tensor:
    """float64 reference; NaN slots set to 0 (its masked padding reads them, see tests)."""
    from kernels import reference

    k, v = (torch.nan_to_num(p.pool[0, i].double(), nan=0.0) for i in (0, 1))
    plan = reference.plan_attention(p.meta)
    return reference.paged_attention(p.query.double(), k, v, plan, p.query.shape[-1] ** -0.5)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def check_attention(report: Report, device: torch.device, small: bool) -> None:
    from kernels.triton_backend import TritonBackend

    gen = torch.Generator(device=device).manual_seed(0)

    def n(tokens: int) -> int:  # contexts shrink under the interpreter
        return max(1, tokens // 16) if small else tokens

    fp16 = Shape("32q/8kv/d128", 32, 8, 128, torch.float16, 32)
    fp32 = Shape("9q/3kv/d64", 9, 3, 64, torch.float32, 8)
    mha = Shape("8q/8kv/d128", 8, 8, 128, torch.bfloat16, 64)
    cases: list[tuple[str, Shape, list[tuple[int, int]], int | None]] = [
        ("decode, ragged", LARGE, [(1, n(c)) for c in (4099, 16384, 1, 777, 2500, 9000)], None),
        ("decode, split 64", SMOL, [(1, n(c)) for c in (16000, 3, 8191)], 8 if small else 64),
        ("prefill, fresh + chunk", LARGE, [(n(2048), n(2048)), (n(1000), n(5000))], None),
        ("mixed", SMOL, [(1, n(4097)), (n(700), n(700)), (1, 33), (n(300), n(1900))], None),
        ("mixed fp16 bs32", fp16, [(1, n(3000)), (n(513), n(1200))], None),
        ("mixed fp32 bs8 split 4", fp32, [(1, n(2000)), (n(129), n(600))], 4),
        ("decode mha bs64", mha, [(1, n(6000)), (1, 64)], None),
    ]
    rows = []
    for name, shape, lens, split in cases:
        p = build_paged(lens, shape, device, gen)
        backend = TritonBackend(split_kv=split)
        plan = backend.plan(p.meta)
        out = attend(backend, p, plan)
        launch, _ = plan.launch_for(shape.q_heads, shape.kv_heads, shape.head_dim, shape.dtype)
        err = rel_err(out, reference_attention(p))
        rows.append(
            [name, shape.name, str(shape.dtype)[6:], str(shape.block_size),
             str(len(lens)), str(p.meta.num_tokens), str(p.meta.max_seq_len),
             str(launch.num_splits), report.check(name, err, TOL[shape.dtype])]
        )  # fmt: skip
        del p, out
    report.say("### Attention vs reference (float64)")
    header = ["case", "shape", "dtype", "block", "seqs", "tokens", "max ctx", "splits", "rel err"]
    report.table(header, rows)


def check_cache_ops(report: Report, device: torch.device, small: bool) -> None:
    from kernels import reference
    from kernels.triton_backend import TritonBackend

    backend = TritonBackend()
    gen = torch.Generator(device=device).manual_seed(1)
    layers, blocks, heads, dim = (2, 40, 3, 64) if small else (32, 2048, 8, 128)
    n = 8 if small else 256
    pool = torch.randn(layers, 2, blocks, 16, heads, dim, generator=gen, device=device)
    pool = pool.to(torch.bfloat16)
    rows = []

    expected = pool.clone()
    tokens = 64 if small else 8192
    slots = torch.randperm(blocks * 16, generator=gen, device=device)[:tokens]
    key = torch.randn(tokens, heads, dim, generator=gen, device=device).bfloat16()
    value = torch.randn(tokens, heads, dim, generator=gen, device=device).bfloat16()
    layer = layers - 1
    backend.write_kv(key, value, pool[layer, 0], pool[layer, 1], slots)
    reference.write_kv(key, value, expected[layer, 0], expected[layer, 1], slots)
    err = _mismatch(pool, expected)
    rows.append(["write_kv", f"{tokens} tokens", report.check("write_kv", err, 0)])

    ids = torch.randperm(blocks, generator=gen, device=device)[: 2 * n]
    src, dst = ids[:n], ids[n:]
    backend.copy_blocks(pool, src, dst)
    reference.copy_blocks(expected, src, dst)
    err = _mismatch(pool, expected)
    rows.append(["copy_blocks", f"{n} x {layers} layers", report.check("copy_blocks", err, 0)])

    host = torch.device("cpu")
    cpu_pool = torch.zeros((layers, 2, blocks // 2, 16, heads, dim), dtype=pool.dtype)
    if device.type == "cuda":
        cpu_pool = cpu_pool.pin_memory()
    out_ids = torch.randperm(blocks // 2)[:n]
    backend.swap_blocks(pool, cpu_pool, src.to(host), out_ids)
    err = _mismatch(cpu_pool[:, :, out_ids], pool[:, :, src].to(host))
    rows.append(["swap out", f"{n} x {layers} layers", report.check("swap out", err, 0)])
    back = torch.randperm(blocks, generator=gen, device=device)[:n]
    backend.swap_blocks(cpu_pool, pool, out_ids, back.to(host))
    err = _mismatch(pool[:, :, back].to(host), cpu_pool[:, :, out_ids])
    rows.append(["swap in", f"{n} x {layers} layers", report.check("swap in", err, 0)])
    report.say("### Cache ops vs reference (bit for bit)")
    report.table(["op", "blocks", "mismatched fraction"], rows)


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    same = (a == b) | (a.isnan() & b.isnan())
    return 1.0 - float(same.float().mean())


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of `fn`."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=20, rep=80, return_mode="median"))


def measure_copy(device: torch.device, nbytes: int = 2 * GiB) -> tuple[float, float]:
    """Milliseconds of one device-to-device copy of `nbytes`, and GB/s counting the bytes
    read and written: the memory-bound ceiling. On the CPU, wall time of a few copies (the
    median), for runs that only exercise the code."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        ms = bench(lambda: dst.copy_(src))
    else:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(1000 * (time.perf_counter() - start))
        ms = sorted(times)[len(times) // 2]
    return ms, 2 * nbytes / ms / 1e6


def copy_bandwidth(report: Report, device: torch.device) -> float:
    ms, bw = measure_copy(device)
    props = torch.cuda.get_device_properties(device)
    report.say(
        f"Device: {props.name}, {props.multi_processor_count} SMs, L2 {_l2(device) >> 20} MiB; "
        f"torch {torch.__version__}, triton {_triton_version()}"
    )
    report.say(f"Device-to-device copy of 2 GiB: {ms:.3f} ms = {bw:.0f} GB/s (read + write)")
    report.say()
    return bw


def _l2(device: torch.device) -> int:
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


def bench_decode(report: Report, device: torch.device, copy_bw: float, sizes: Sizes) -> None:
    from kernels.triton_backend import TritonBackend

    backend = TritonBackend()
    gen = torch.Generator(device=device).manual_seed(2)
    for shape in (LARGE, SMOL):
        rows = []
        for batch, ctx in itertools.product(sizes.batches, sizes.contexts):
            sets = []  # several input sets, each timed in turn: no cache sees one twice running
            for _ in range(_input_sets(batch, ctx, shape, device)):
                p = _decode_batch(batch, ctx, shape, device, gen)
                sets.append((p, backend.plan(p.meta), *_contiguous_kv(p, batch, ctx)))
            p, plan, k, v = sets[0]
            err = rel_err(attend(backend, p, plan), _sdpa_decode(p.query, k, v))
            run_triton = [functools.partial(attend, backend, p, pl) for p, pl, _, _ in sets]
            run_sdpa = [functools.partial(_sdpa_decode, p.query, k, v) for p, _, k, v in sets]
            t_call, s_call = bench(_rotating(run_triton)), bench(_rotating(run_sdpa))
            try:
                t_gpu, s_gpu = gpu_ms(run_triton, device), gpu_ms(run_sdpa, device)
            except Exception as exc:  # graph capture refused: keep the per-call times
                report.failures.append(f"CUDA graph timing of decode {batch}x{ctx}: {exc!r}")
                t_gpu, s_gpu = t_call, s_call
            launch, _ = plan.launch_for(shape.q_heads, shape.kv_heads, shape.head_dim, shape.dtype)
            bw = p.kv_bytes / t_gpu / 1e6
            check = report.check(f"decode {shape.name} {batch}x{ctx}", err, 2e-2)
            rows.append(
                [str(batch), str(ctx), str(launch.num_splits), str(len(sets)),
                 f"{1000 * t_gpu:.1f}", f"{bw:.0f}", f"{100 * bw / copy_bw:.0f}%",
                 f"{1000 * s_gpu:.1f}", f"{s_gpu / t_gpu:.2f}", f"{1000 * t_call:.1f}",
                 f"{1000 * s_call:.1f}", check]
            )  # fmt: skip
            print(f"  decode {shape.name} batch {batch} ctx {ctx}: {rows[-1]}", flush=True)
            del sets, p, plan, k, v, run_triton, run_sdpa
            torch.cuda.empty_cache()
        report.say(
            f"### Decode attention, one layer, {shape.name} {str(shape.dtype)[6:]}, block 16"
        )
        report.say(
            "GPU µs: device time per call (CUDA graph replay of every input set in turn, each "
            "after an L2 flush, flush time subtracted); K/V GB/s from it. Per call µs: do_bench "
            "median over the input sets in turn, which includes the host's launch cost when that "
            "exceeds the GPU time."
        )
        report.say()
        header = ["batch", "ctx", "splits", "input sets", "triton GPU µs", "K/V GB/s",
                  "of copy BW", "SDPA GPU µs", "SDPA / triton", "triton per call µs",
                  "SDPA per call µs", "rel err vs SDPA"]  # fmt: skip
        report.table(header, rows)


def _input_sets(batch: int, ctx: int, shape: Shape, device: torch.device) -> int:
    """Three input sets where they fit in 80% of free memory (paged K/V, their contiguous copy
    for SDPA, and the copy's gather on the way), else fewer."""
    kv = 2 * batch * ctx * shape.kv_heads * shape.head_dim * torch.finfo(shape.dtype).bits // 8
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(3, int(0.8 * free) // (2 * kv + kv // 2)))


def _rotating(fns: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs the next of `fns` at each call."""
    turn = itertools.cycle(fns)
    return lambda: next(turn)()


@dataclass(frozen=True)
class SweepPoint:
    batch: int
    ctx: int
    shape: Shape


SWEEP_POINTS = (
    SweepPoint(64, 4096, LARGE),
    SweepPoint(16, 4096, LARGE),
    SweepPoint(64, 4096, SMOL),
)


def sweep_grid(point: SweepPoint) -> list[tuple[LaunchTuning, str]]:
    """What a sweep times: (launch tuning, cache layout) pairs. At the target point: tile x
    warps x stages x splits, with the shortcuts on, and the default launch with each shortcut
    off; elsewhere only the split count (the knob that depends most on the batch), with and
    without a register cap. Then a few of them again over a head-major cache (`hnd`), where a
    block's 16 tokens of one head are 4 KiB in a row instead of 256-byte pieces 2 KiB apart.
    About 60 compiles: ~3 min on an H200."""
    from kernels.attention_launch import LaunchTuning

    if point != SWEEP_POINTS[0]:
        # With and without registers capped at the occupancy the split policy assumes.
        cap = 65536 // ((4 if point.shape.head_dim > 64 else 8) * 4 * 32)
        grid = [
            LaunchTuning(num_splits=splits, max_registers=regs)
            for splits, regs in itertools.product((1, 2, 4, 8), (None, cap))
        ]
        return [(t, "nhd") for t in grid] + [(LaunchTuning(), "hnd")]
    # Triton 3.6 double-buffers K/V from 5 stages on (3 and 4 compile alike; kernel_code.py).
    axes = itertools.product((32, 64, 128), (4, 8), (2, 3, 5), (1, 2))
    grid = [
        LaunchTuning(tile_n=t, num_warps=w, num_stages=st, num_splits=sp) for t, w, st, sp in axes
    ]
    ablations = [
        LaunchTuning(skip_masks=False),
        LaunchTuning(narrow_offsets=False),
        LaunchTuning(max_registers=128),
    ]
    head_major = [
        LaunchTuning(),
        LaunchTuning(num_splits=2),
        LaunchTuning(tile_n=128, num_warps=8),
        LaunchTuning(num_stages=5),
    ]
    return [(t, "nhd") for t in [*grid, *ablations]] + [(t, "hnd") for t in head_major]


def sweep_launches(report: Report, device: torch.device, copy_bw: float) -> None:
    """Time every configuration of `sweep_grid` against SDPA on the same batch, fastest first."""
    from kernels.triton_backend import TritonBackend

    gen = torch.Generator(device=device).manual_seed(5)
    for point in SWEEP_POINTS:
        nhd = _decode_batch(point.batch, point.ctx, point.shape, device, gen)
        batches = {"nhd": nhd, "hnd": head_major(nhd)}
        k, v = _contiguous_kv(nhd, point.batch, point.ctx)
        expected = _sdpa_decode(nhd.query, k, v)
        sdpa_ms = gpu_ms(functools.partial(_sdpa_decode, nhd.query, k, v), device)
        default = TritonBackend().plan(nhd.meta)
        picked, _ = default.launch_for(
            point.shape.q_heads, point.shape.kv_heads, point.shape.head_dim, point.shape.dtype
        )
        timed: list[tuple[float, list[str]]] = []
        for tuning, layout in sweep_grid(point):
            p = batches[layout]
            backend = TritonBackend(tuning=tuning)
            plan = backend.plan(p.meta)
            launch, _ = plan.launch_for(
                point.shape.q_heads, point.shape.kv_heads, point.shape.head_dim, point.shape.dtype
            )
            knobs = [layout, str(launch.tile_n), str(launch.num_warps), str(launch.num_stages),
                     str(launch.num_splits), "yes" if launch.skip_masks else "no",
                     "yes" if launch.narrow_offsets else "no",
                     str(launch.max_registers or "-")]  # fmt: skip
            try:
                err = rel_err(attend(backend, p, plan), expected)
                ms = gpu_ms(functools.partial(attend, backend, p, plan), device)
            except Exception as exc:  # e.g. shared memory the card does not have
                failed = f"did not run: {type(exc).__name__}"
                timed.append((math.inf, [*knobs, failed, "", "", ""]))
                continue
            check = report.check(f"sweep {point} {layout} {tuning}", err, 2e-2)
            is_default = launch == picked and layout == "nhd"
            bw = p.kv_bytes / ms / 1e6
            timed.append(
                (ms, [*knobs, f"{1000 * ms:.1f}" + (" (default)" if is_default else ""),
                      f"{100 * bw / copy_bw:.0f}%", f"{sdpa_ms / ms:.3f}", check])
            )  # fmt: skip
        timed.sort(key=lambda item: item[0])
        report.say(
            f"### Launch sweep: decode {point.batch} x {point.ctx}, {point.shape.name} "
            f"{str(point.shape.dtype)[6:]}; SDPA {1000 * sdpa_ms:.1f} µs"
        )
        header = ["layout", "tile", "warps", "stages", "splits", "skip masks", "int32 offsets",
                  "max regs", "GPU µs", "of copy BW", "SDPA / triton",
                  "rel err vs SDPA"]  # fmt: skip
        report.table(header, [row for _, row in timed])
        del nhd, batches, p, k, v, expected
        torch.cuda.empty_cache()


def head_major(p: Paged) -> Paged:
    """The same batch over a head-major cache: memory [.., N, Hkv, bs, D], viewed as the
    [.., N, bs, Hkv, D] the kernels take (they address it through its strides)."""
    pool = p.pool.transpose(3, 4).contiguous().transpose(3, 4)
    return Paged(meta=p.meta, pool=pool, query=p.query)


def gpu_ms(
    fn: Callable[[], object] | Sequence[Callable[[], object]], device: torch.device, reps: int = 25
) -> float:
    """Device milliseconds of one call, cold L2, without host overhead.

    `fn` is one callable or one per input set. Two CUDA graphs, [flush the L2, fn] for each
    set in turn and the flushes alone, each replayed `reps` times between CUDA events; the
    difference of the medians over the number of sets is one call's time.
    """
    fns = [fn] if callable(fn) else list(fn)
    flush = torch.empty(2 * _l2(device), dtype=torch.uint8, device=device)

    def flushed() -> None:
        for f in fns:
            flush.zero_()
            f()

    def flushes() -> None:
        for _ in fns:
            flush.zero_()

    return (_graph_median_ms(flushed, reps) - _graph_median_ms(flushes, reps)) / len(fns)


def _graph_median_ms(fn: Callable[[], object], reps: int) -> float:
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # allocations and compiles happen before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times: list[float] = []
    for _ in range(reps):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in "se")  # type: ignore[no-untyped-call]
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)))
    return sorted(times)[len(times) // 2]


def host_costs(report: Report, device: torch.device, sizes: Sizes) -> None:
    """What the host spends per call, where small batches are bound by it."""
    from kernels.triton_backend import TritonBackend

    backend = TritonBackend()
    gen = torch.Generator(device=device).manual_seed(4)
    rows = []
    for batch, ctx in sizes.host_cost_cases:
        p = _decode_batch(batch, ctx, LARGE, device, gen)
        plan = backend.plan(p.meta)
        launch, _ = plan.launch_for(LARGE.q_heads, LARGE.kv_heads, LARGE.head_dim, LARGE.dtype)
        kernels = 2 if launch.num_splits > 1 else 1
        rows.append(
            [f"{batch} x {ctx}", f"{_host_us(functools.partial(backend.plan, p.meta)):.1f}",
             f"{_host_us(functools.partial(attend, backend, p, plan)):.1f}", str(kernels)]
        )  # fmt: skip
    report.say(f"### Host cost per call (decode, {LARGE.name}; no device sync)")
    report.table(["batch x ctx", "plan() µs", "attend() µs", "kernel launches"], rows)


def _host_us(fn: Callable[[], object], calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * spent / calls


def _decode_batch(
    batch: int, ctx: int, shape: Shape, device: torch.device, gen: torch.Generator
) -> Paged:
    """`batch` sequences of `ctx` tokens each, built in one go (build_paged is per sequence)."""
    from kernels.metadata import AttentionMetadata

    bs, heads, dim = shape.block_size, shape.kv_heads, shape.head_dim
    per_seq = math.ceil(ctx / bs)
    num_blocks = batch * per_seq
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    tables = perm.view(batch, per_seq).to(torch.int32)
    pool = torch.empty((1, 2, num_blocks, bs, heads, dim), dtype=shape.dtype, device=device)
    pool.normal_(generator=gen)
    pos = torch.full((batch,), ctx - 1, device=device)
    slots = tables[torch.arange(batch, device=device), pos // bs].long() * bs + pos % bs
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
        block_tables=tables,
        block_size=bs,
        query_lens_host=[1] * batch,
        seq_lens_host=[ctx] * batch,
    )
    query = torch.randn(batch, shape.q_heads, dim, generator=gen, device=device).to(shape.dtype)
    return Paged(meta=meta, pool=pool, query=query)


def _contiguous_kv(p: Paged, batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same K/V as contiguous [B, Hkv, ctx, D] tensors, for SDPA."""
    tables = p.meta.block_tables.long()  # [B, nb]
    out = []
    for i in (0, 1):
        blocks = p.pool[0, i][tables]  # [B, nb, bs, Hkv, D]
        flat = blocks.flatten(1, 2)[:, :ctx]  # [B, ctx, Hkv, D]
        out.append(flat.transpose(1, 2).contiguous())
    return out[0], out[1]


def _sdpa_decode(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    q = query.unsqueeze(2)  # [B, Hq, 1, D]
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa).squeeze(2)  # [B, Hq, D]


def bench_batches(report: Report, device: torch.device, sizes: Sizes) -> None:
    """A mixed prefill+decode step and a prefill step, against the torch reference backend."""
    from kernels.backend import TorchBackend
    from kernels.triton_backend import TritonBackend

    gen = torch.Generator(device=device).manual_seed(3)
    chunk, decodes, ctx = sizes.prefill, sizes.mixed_decodes, sizes.mixed_context
    cases = {
        f"mixed: {chunk}-token chunk over {chunk} cached + {chunk // 4} fresh + "
        f"{decodes} decodes at ~{ctx}": [(chunk, 2 * chunk), (chunk // 4, chunk // 4)]
        + [(1, ctx - 300 + 17 * i) for i in range(decodes)],
        f"prefill: 4 x {chunk} fresh": [(chunk, chunk)] * 4,
    }
    rows = []
    for name, lens in cases.items():
        p = build_paged(lens, LARGE, device, gen)
        triton_backend, torch_backend = TritonBackend(), TorchBackend()
        t_plan, r_plan = triton_backend.plan(p.meta), torch_backend.plan(p.meta)
        scale = LARGE.head_dim**-0.5
        k, v = p.pool[0, 0], p.pool[0, 1]
        clean = [torch.nan_to_num(c, nan=0.0) for c in (k, v)]
        err = rel_err(attend(triton_backend, p, t_plan), reference_attention(p))
        t_ms = bench(functools.partial(attend, triton_backend, p, t_plan))
        r_ms = bench(
            functools.partial(
                torch_backend.attend, p.query, clean[0], clean[1], p.meta, r_plan, scale
            )
        )
        flops = (
            4
            * LARGE.q_heads
            * LARGE.head_dim
            * sum(q * (s - q) + q * (q + 1) // 2 for q, s in lens)
        )
        launch, _ = t_plan.launch_for(LARGE.q_heads, LARGE.kv_heads, LARGE.head_dim, LARGE.dtype)
        rows.append(
            [name, str(p.meta.num_tokens), str(launch.num_splits), f"{1000 * t_ms:.0f}",
             f"{flops / t_ms / 1e9:.0f}", f"{1000 * r_ms:.0f}", f"{r_ms / t_ms:.1f}",
             report.check(name, err, TOL[LARGE.dtype])]
        )  # fmt: skip
    report.say(f"### Prefill and mixed batches, one layer, {LARGE.name} bf16")
    header = ["batch", "tokens", "splits", "triton µs", "TFLOP/s", "torch ref µs",
              "ref / triton", "rel err vs float64"]  # fmt: skip
    report.table(header, rows)


def bench_cache_ops(report: Report, device: torch.device, sizes: Sizes) -> None:
    from kernels import reference
    from kernels.triton_backend import TritonBackend

    backend = TritonBackend()
    layers, blocks, heads, dim, bs = sizes.cache_layers, sizes.cache_blocks, 8, 128, 16
    pool = torch.randn(layers, 2, blocks, bs, heads, dim, device=device).to(torch.bfloat16)
    block_bytes = layers * 2 * bs * heads * dim * 2
    rows = []

    tokens = sizes.write_tokens
    slots = torch.randperm(blocks * bs, device=device)[:tokens]
    key = torch.randn(tokens, heads, dim, device=device).bfloat16()
    nbytes = 2 * 2 * tokens * heads * dim * 2  # K and V, read and written
    kc, vc = pool[layers - 1, 0], pool[layers - 1, 1]
    run = functools.partial(backend.write_kv, key, key, kc, vc, slots)
    run_ref = functools.partial(reference.write_kv, key, key, kc, vc, slots)
    t, r = bench(run), bench(run_ref)
    g = _gpu_ms_or(report, "write_kv", run, device, t)
    rows.append(["write_kv", f"{tokens} tokens", f"{1000 * g:.1f}", f"{nbytes / g / 1e6:.0f}",
                 f"{1000 * t:.1f}", f"{1000 * r:.1f}", f"{r / t:.1f}"])  # fmt: skip

    n = sizes.moved_blocks
    ids = torch.randperm(blocks, device=device)
    src, dst = ids[:n], ids[n : 2 * n]
    nbytes = 2 * n * block_bytes
    run = functools.partial(backend.copy_blocks, pool, src, dst)
    run_ref = functools.partial(reference.copy_blocks, pool, src, dst)
    t, r = bench(run), bench(run_ref)
    g = _gpu_ms_or(report, "copy_blocks", run, device, t)
    rows.append(["copy_blocks", f"{n} blocks x {layers} layers", f"{1000 * g:.1f}",
                 f"{nbytes / g / 1e6:.0f}", f"{1000 * t:.1f}", f"{1000 * r:.1f}",
                 f"{r / t:.1f}"])  # fmt: skip

    cpu_blocks = 4 * n
    cpu_pool = torch.zeros((layers, 2, cpu_blocks, bs, heads, dim), dtype=pool.dtype)
    cpu_pool = cpu_pool.pin_memory()  # as the engine's CPU pool
    host_ids = torch.randperm(cpu_blocks)[:n]
    src_host = src.cpu()
    swaps = {
        "swap out (GPU -> CPU)": (pool, cpu_pool, src_host, host_ids),
        "swap in (CPU -> GPU)": (cpu_pool, pool, host_ids, src_host),
    }
    for name, swap_args in swaps.items():
        t = _wall_ms(functools.partial(backend.swap_blocks, *swap_args), reps=sizes.swap_reps)
        rows.append([name, f"{n} blocks x {layers} layers", "", f"{n * block_bytes / t / 1e6:.1f}",
                     f"{1000 * t:.0f}", "", ""])  # fmt: skip
    report.say("### Cache ops (block 16, 8 kv heads, d128, bf16)")
    report.say(
        "GPU µs: device time (CUDA graph replay after an L2 flush), GB/s from it (for swaps, "
        "from the wall time). Per call µs: do_bench median, host launch cost included; the "
        "torch reference is timed the same way, so ref / triton compares per-call times."
    )
    report.say()
    header = ["op", "size", "triton GPU µs", "GB/s", "triton per call µs", "torch ref per call µs",
              "ref / triton"]  # fmt: skip
    report.table(header, rows)


def _gpu_ms_or(
    report: Report, what: str, fn: Callable[[], object], device: torch.device, per_call_ms: float
) -> float:
    """Device time of `fn`, or its per-call time when a CUDA graph cannot capture it."""
    try:
        return gpu_ms(fn, device)
    except Exception as exc:
        report.failures.append(f"CUDA graph timing of {what}: {exc!r}")
        return per_call_ms


def _wall_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def section(report: Report, fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """Run one part; a crash is reported as a failure and the next part still runs."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # a one-shot run on a borrowed GPU should report everything
        traceback.print_exc()
        report.failures.append(f"{fn.__name__} crashed: {exc!r}")
        report.say(f"**{fn.__name__} crashed: {exc!r}**")
        report.say()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, help="also write the tables to this markdown file")
    parser.add_argument("--quick", action="store_true", help="fewer timing configs")
    parser.add_argument(
        "--sweep", action="store_true", help="also time a grid of launch configurations"
    )
    parser.add_argument(
        "--sweep-only", action="store_true", help="only the grid (after a run without --sweep)"
    )
    args = parser.parse_args(argv)
    report = Report(args.out)
    started = time.perf_counter()
    report.say("# Triton kernels: correctness and timings")
    report.say()
    if args.sweep_only and not torch.cuda.is_available():
        report.say("No CUDA device: no sweep.")
    elif args.sweep_only:
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = False
        section(report, sweep_launches, report, device, copy_bandwidth(report, device))
    elif torch.cuda.is_available():
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = False
        sizes = QUICK if args.quick else FULL
        section(report, check_attention, report, device, small=False)
        section(report, check_cache_ops, report, device, small=False)
        copy_bw = copy_bandwidth(report, device)
        section(report, bench_decode, report, device, copy_bw, sizes)
        section(report, host_costs, report, device, sizes)
        section(report, bench_batches, report, device, sizes)
        section(report, bench_cache_ops, report, device, sizes)
        if args.sweep:
            section(report, sweep_launches, report, device, copy_bw)
    else:
        # Must precede the first import of a kernel module: Triton reads it at decoration.
        os.environ["TRITON_INTERPRET"] = "1"
        report.say("No CUDA device: correctness only, at small sizes, under the Triton "
                   "interpreter; no timings.")  # fmt: skip
        report.say()
        check_attention(report, torch.device("cpu"), small=True)
        check_cache_ops(report, torch.device("cpu"), small=True)
    verdict = (
        "all checks passed" if not report.failures else "FAILED: " + "; ".join(report.failures)
    )
    report.say(f"{verdict} ({time.perf_counter() - started:.0f} s)")
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
