"""Decode throughput of the engine on the default model, per weight format and CPU kernel
version, side by side.

For each batch size, N requests with distinct ~200-token prompts are prefilled, then the engine
runs decode steps with all N sequences in the batch. Reported per batch size, weight format
(auto: the GGUF's blocks as stored) and CPU kernel version (--cpu-isa, each forced in turn):
aggregate generated tokens/s over the timed decode steps, mean step time, the share of each
step spent in matmuls (every projection and the LM head, timed around each call), and the share
spent outside the model forward (scheduling, block moves and input tensors, sampling,
detokenizing and stop checks). One engine per format, all loaded at once; each batch size runs
every format in turn, so a neighbour's load on a shared machine falls on all of them alike.

    .venv/bin/python -m benchmarks.engine_step [--weights auto fp32 bf16 int8 int4]
        [--cpu-isa auto generic avx2 avx512 vnni] [--weight-layout auto stored]
        [--batch 1 4 8 32 64] [--steps 20]
        [--dtype auto] [--threads 1 2] [--decode-threads 1 2]

Read bandwidth: before the engines start, the machine's read bandwidth is measured on the
decode stack's thread count (a 1 GiB fp32 sum through torch, best of five), and each batch-1
row of packed weights reports the bytes its step reads (every projection and the LM head, as
stored) over its step time, as a share of that bandwidth: how close one user's decode comes to
the memory-bound limit (issue 37's bar: 80%).

With --synthetic SHAPE... the models are benchmarks/synthetic.py's, random weights of real
shapes built on the device (bf16 on CUDA), and each shape runs with CUDA graphs on and off
(--cuda-graphs on off) in place of the weight formats. Then the step time is set against the
weight-read bound: the bytes of weights a decode step reads over the device's measured copy
bandwidth (and the same with the step's K/V bytes added). On CUDA the benchmark synchronizes
after each forward, so the forward's share is the device's time and not only its launches.
Without CUDA, "on" runs the same static buffers and padding eagerly (EagerDecodeGraphs), so a
CPU run exercises the path; its figures mean nothing for a GPU.

    python -m benchmarks.engine_step --synthetic smollm2-135m llama-3.2-1b llama-3-8b \
        --batch 1 8 64 256 --steps 20 --prompt-len 128 --json results/engine_step.json
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels.cpu import topology
from kernels.cpu.dispatch import cpu_description
from kernels.cpu.stack import DecoderStack
from service.engine.config import EngineConfig
from service.engine.cuda_graphs import (
    CudaDecodeGraphs,
    EagerDecodeGraphs,
    StepRunner,
    graph_batch_sizes,
)
from service.engine.engine import LLMEngine
from service.engine.loader import LoadedModel
from service.engine.model import DecoderModel, Linear
from service.engine.params import SamplingParams
from service.engine.plan import dtype_name, plan_engine
from service.engine.quant import QuantLinear
from service.engine.scheduler import StepBatch
from service.engine.values import StepTiming


class MatmulClock:
    """Seconds spent in the model's matmuls: every projection (hooks around each call, or,
    in a step the native decoder stack runs, the stack's own clock around each of its GEMVs)
    and the LM head (`compute_logits`, which is one matmul and a cast). The CPU runs each
    call to completion, so wall time around it is its cost."""

    def __init__(self, model: DecoderModel, stack: DecoderStack | None = None) -> None:
        self._seconds = 0.0
        self._start = 0.0
        self._stack = stack
        if stack is not None:
            stack.matmul_ns = ctypes.c_int64(0)
        for module in model.modules():
            if isinstance(module, Linear | QuantLinear) and module is not model.lm_head:
                module.register_forward_pre_hook(self._enter)
                module.register_forward_hook(self._leave)
        logits: Callable[[torch.Tensor], torch.Tensor] = model.compute_logits

        def timed_logits(hidden: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out = logits(hidden)
            self._seconds += time.perf_counter() - start
            return out

        model.compute_logits = timed_logits  # type: ignore[method-assign]

    @property
    def seconds(self) -> float:
        inside_stack = self._stack.matmul_ns.value if self._stack and self._stack.matmul_ns else 0
        return self._seconds + inside_stack / 1e9

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._start = time.perf_counter()

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        self._seconds += time.perf_counter() - self._start


class SyncedForward:
    """The engine's step runner, synchronizing with the device after each forward so that
    `StepTiming.forward` holds the device's time, not only the launches (CUDA is async)."""

    def __init__(self, inner: StepRunner, device: torch.device) -> None:
        self.inner = inner
        self.device = device

    def prepare(self, batch: StepBatch) -> Any:
        return self.inner.prepare(batch)

    def execute(self, inputs: Any) -> torch.Tensor:
        logits = self.inner.execute(inputs)
        torch.cuda.synchronize(self.device)
        return logits


def measure(
    engine: LLMEngine,
    clock: MatmulClock | None,
    batch: int,
    steps: int,
    prompt_len: int,
    seed: int,
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
    # Context per sequence over the timed steps: where it starts, plus half of what they add.
    mean_context = statistics.fmean(s.num_tokens for s in engine.scheduler.running)
    mean_context += (steps - 1) / 2
    matmul_before = clock.seconds if clock else 0.0
    generated = 0
    start = time.perf_counter()
    for _ in range(steps):
        generated += len(engine.step())
    elapsed = time.perf_counter() - start
    matmuls = clock.seconds - matmul_before if clock else math.nan
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
        "mean_context": mean_context,
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


def read_bandwidth(threads: int, nbytes: int = 1 << 30) -> float:
    """GB/s that torch's sum reads a tensor of `nbytes` at on `threads` threads (best of 5)."""
    x = torch.ones(nbytes // 4)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(before)
    return nbytes / best / 1e9


def decode_read_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: every packed projection and the LM head as
    stored (a tied table once; an embedding's lookup reads one row and is not counted)."""
    held: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            held |= {p.data.data_ptr(): p.nbytes for p in module.weight.parts}
    return sum(held.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", nargs="+", default=["auto"])
    parser.add_argument(
        "--cpu-isa",
        nargs="+",
        default=["auto"],
        help="CPU kernel versions, each forced in turn (auto: the best this CPU runs)",
    )
    parser.add_argument(
        "--matmul-inputs",
        nargs="+",
        default=["auto"],
        help="the packed products' inputs, each in turn: auto | int8 | fp32",
    )
    parser.add_argument(
        "--weight-layout",
        nargs="+",
        default=["auto"],
        help="how the packed weights lie, each in turn: auto (regrouped for int8) | stored",
    )
    parser.add_argument(
        "--batch-invariant",
        nargs="+",
        choices=["off", "on"],
        default=["off"],
        help="EngineConfig.batch_invariant, each in turn (on: every row as if alone)",
    )
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
    parser.add_argument(
        "--decode-threads",
        type=int,
        nargs="+",
        default=[0],
        help="the native decode stack's threads (packed weights; 0: one per physical core),"
        " each run side by side",
    )
    parser.add_argument(
        "--bandwidth-mib", type=int, default=1024, help="the read-bandwidth probe's tensor"
    )
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    synthetic = parser.add_argument_group("synthetic models (benchmarks/synthetic.py)")
    synthetic.add_argument("--synthetic", nargs="+", metavar="SHAPE", help="random-weight shapes")
    synthetic.add_argument("--cuda-graphs", nargs="+", choices=["on", "off"], default=["on", "off"])
    synthetic.add_argument("--max-model-len", type=int, default=4096, help="graphs plan for it")
    synthetic.add_argument("--max-num-batched-tokens", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.synthetic:
        return synthetic_main(args)

    # 0 is the engine's default: one decode thread per physical core it may run on.
    bandwidth_threads = max(t or topology.usable_physical_cores() for t in args.decode_threads)
    bandwidth = read_bandwidth(bandwidth_threads, args.bandwidth_mib << 20)
    engines: dict[str, tuple[LLMEngine, MatmulClock]] = {}
    for weights, isa, inputs, layout, threads, decode_threads, invariant in itertools.product(
        args.weights, args.cpu_isa, args.matmul_inputs, args.weight_layout, args.threads,
        args.decode_threads, args.batch_invariant,
    ):  # fmt: skip
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            weights=weights,
            cpu_isa=isa,
            matmul_inputs=inputs,
            weight_layout=layout,
            max_num_seqs=max(args.batch),
            max_model_len=1024,
            kv_cache_mb=args.kv_cache_mb,
            num_threads=threads,
            decode_threads=decode_threads,
            batch_invariant=invariant == "on",
        )
        engine = LLMEngine(config)  # its crossover trial runs at `threads`
        name = weights if len(args.cpu_isa) == 1 else f"{weights} {isa}"
        if len(args.matmul_inputs) > 1:
            name += f" {inputs}"
        if len(args.weight_layout) > 1:
            name += f" {layout}"
        if len(args.threads) > 1:
            name += f" {threads}t"
        if len(args.decode_threads) > 1:
            name += f" stack {engine.runner.native_decode_threads}t"
        if len(args.batch_invariant) > 1:
            name += f" invariant {invariant}"
        engines[name] = (engine, MatmulClock(engine.runner.model, engine.runner.decoder_stack))
    rows: dict[str, list[dict[str, float]]] = {w: [] for w in engines}
    for b in args.batch:
        for name, (engine, clock) in engines.items():
            torch.set_num_threads(engine.config.num_threads)
            rows[name].append(measure(engine, clock, b, args.steps, args.prompt_len, seed=b))
    for engine, _ in engines.values():
        engine.check_balanced()

    first = next(iter(engines.values()))[0]
    print(
        f"engine_step on {cpu_description()}: {first.model_id}, "
        f"{dtype_name(first.activation_dtype)} activations, "
        f"{dtype_name(first.kv_cache_dtype)} KV cache, "
        f"torch threads {' and '.join(map(str, args.threads))}, decode stack threads "
        f"{' and '.join(map(str, args.decode_threads))}, {args.steps} decode steps, "
        f"~{args.prompt_len}-token prompts"
    )
    for weights, (engine, _) in engines.items():
        print(f"- {weights}: {engine.runner.model.weights_description}")
    print(f"- read bandwidth: {bandwidth:.1f} GB/s on {bandwidth_threads} thread(s)")
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
    ones = [(w, r) for w in names for r in rows[w] if r["batch"] == 1]
    packed = [(w, r, decode_read_bytes(engines[w][0].runner.model)) for w, r in ones]
    if any(read for _, _, read in packed):
        print()
        print(f"Batch 1 against the read bandwidth ({bandwidth:.1f} GB/s):")
        print()
        print("| weights | weight bytes a step | step ms | GB/s read | share of bandwidth |")
        print("|---|---:|---:|---:|---:|")
        for w, r, read in packed:
            rate = read / (r["step_ms"] / 1000) / 1e9
            r |= {"read_bytes": read, "read_gbps": rate, "bandwidth_gbps": bandwidth}
            print(
                f"| {w} | {read / 1e6:.1f} MB | {r['step_ms']:.1f} | {rate:.1f} | "
                f"{100 * rate / bandwidth:.0f}% |"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def synthetic_main(args: argparse.Namespace) -> int:
    """Each synthetic shape with graphs on and off, its steps against the weight-read bound."""
    from benchmarks.kernels import measure_copy
    from benchmarks.synthetic import build, weight_read_bytes

    probe = plan_engine(EngineConfig(dtype=args.dtype))
    device, dtype = probe.device, probe.activation_dtype
    copy_ms, copy_gbps = measure_copy(device, (2 << 30) if device.type == "cuda" else (256 << 20))
    # Row by row as measured, so a run cut short still reports what it timed.
    _print_header(device, dtype, copy_ms, copy_gbps, args)
    rows: list[dict[str, Any]] = []
    for shape in args.synthetic:
        loaded = build(shape, device=device, dtype=dtype)
        weight_bytes = weight_read_bytes(loaded.model)
        a = loaded.args
        kv_token_bytes = a.num_layers * 2 * a.kv_size * dtype.itemsize
        for graphs in args.cuda_graphs:
            start = time.perf_counter()
            engine = _synthetic_engine(loaded, args, graphs == "on")
            startup = time.perf_counter() - start
            path = _decode_path(engine)
            if device.type == "cuda":
                engine.step_runner = SyncedForward(engine.step_runner, device)
            for b in args.batch:
                r: dict[str, Any] = measure(engine, None, b, args.steps, args.prompt_len, seed=b)
                kv_bytes = b * r["mean_context"] * kv_token_bytes
                r |= {
                    "shape": shape,
                    "graphs": graphs,
                    "decode_path": path,
                    "startup_s": startup,
                    "weight_bytes": weight_bytes,
                    "kv_bytes": kv_bytes,
                    "weight_bound_ms": weight_bytes / copy_gbps / 1e6,
                    "weight_kv_bound_ms": (weight_bytes + kv_bytes) / copy_gbps / 1e6,
                }
                rows.append(r)
                _print_row(r)
            engine.check_balanced()
            del engine
            _release(device)
        del loaded
        _release(device)
    print()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"copy_gbps": copy_gbps, "rows": rows}, indent=1))
    return 0


def _synthetic_engine(loaded: LoadedModel, args: argparse.Namespace, graphs: bool) -> LLMEngine:
    block_size = EngineConfig().block_size
    max_batch = max(args.batch)
    # Room for every sequence's prompt and every step's token: no preemption.
    per_seq = -(-(args.prompt_len + args.steps + 3) // block_size)
    config = EngineConfig(
        device=str(next(loaded.model.parameters()).device),
        max_num_seqs=max_batch,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=max(args.max_num_batched_tokens, max_batch),
        num_device_blocks=max_batch * per_seq,
        num_cpu_blocks=0,
        cuda_graphs=graphs,
    )
    engine = LLMEngine(config, loaded=loaded)
    if graphs and engine.runner.device.type != "cuda":
        # No CUDA: the same buffers and padding, run eagerly, so the path is exercised.
        eager = EagerDecodeGraphs(
            engine.runner,
            sizes=graph_batch_sizes(config.max_num_seqs),
            max_model_len=engine.max_model_len,
        )
        eager.capture()
        engine.step_runner = eager
    return engine


def _decode_path(engine: LLMEngine) -> str:
    runner = engine.step_runner
    if isinstance(runner, CudaDecodeGraphs):
        return f"CUDA graphs ({len(runner.sizes)} sizes)"
    if isinstance(runner, EagerDecodeGraphs):
        return "static buffers, eager (no CUDA)"
    return "eager"


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _print_header(
    device: torch.device,
    dtype: torch.dtype,
    copy_ms: float,
    copy_gbps: float,
    args: argparse.Namespace,
) -> None:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"engine_step, synthetic models (RANDOM weights, benchmarks/synthetic.py): {where}, "
        f"{dtype_name(dtype)}, torch {torch.__version__}; {args.steps} decode steps after "
        f"~{args.prompt_len}-token prompts, max_model_len {args.max_model_len}. Copy "
        f"bandwidth {copy_gbps:.0f} GB/s (read + write, {copy_ms:.2f} ms per copy); bound = "
        f"bytes a step must read / that bandwidth."
    )
    print()
    print(
        "| shape | graphs | decode path | batch | tokens/s | step ms | forward ms | outside "
        "forward | weight bound ms | step / bound | weights+KV bound ms | start-up s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)


def _print_row(r: dict[str, Any]) -> None:
    print(
        f"| {r['shape']} | {r['graphs']} | {r['decode_path']} | {r['batch']} | "
        f"{r['tokens_per_s']:.0f} | {r['step_ms']:.2f} | {r['forward_ms']:.2f} | "
        f"{100 * r['overhead_share']:.1f}% | {r['weight_bound_ms']:.3f} | "
        f"{r['step_ms'] / r['weight_bound_ms']:.2f}x | {r['weight_kv_bound_ms']:.3f} | "
        f"{r['startup_s']:.1f} |",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
