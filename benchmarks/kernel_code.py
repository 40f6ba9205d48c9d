"""What the attention kernel compiles to on a Hopper GPU, found without one.

Compiles `_paged_attention_kernel` ahead of time for sm_90 with Triton's own compiler and the
ptxas it ships, for the arguments the engine passes on a given batch: the call is recorded from
`launch_paged_attention` itself (on meta tensors, so no memory is touched) and specialised by
Triton's own rules (16-divisible integers and pointers, integers equal to 1). Per launch it
reports shared memory, registers, local-memory spills, and the instruction mix of each inner
loop of the SASS: the number of instructions a tile costs, whether K/V arrive as 16-byte
asynchronous copies (LDGSTS.128), and what else the loop issues.

A session without a GPU sees what a change does to the code the GPU will run; only a GPU can
say what it does to the time (benchmarks/kernels.py). The GPU image runs Triton 3.6; other
versions compile differently, so for figures that match it, put that version first:

    .venv/bin/pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 .venv/bin/python -m benchmarks.kernel_code [--out code.md]

With --matrix it instead compiles every launch over dtype x head dim x GQA x batch kind and
says which failed to compile or spilled (about 100 launches, two minutes).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import math
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton

from kernels import triton_attention
from kernels.attention_launch import LaunchTuning, choose_launch, split_scratch

# The H200 the issue targets: sm_90, 132 SMs.
SM90 = (90, 132)
TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Case:
    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    tuning: LaunchTuning | None = None


def decode(batch: int, ctx: int, **kwargs: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (1,) * batch, (ctx,) * batch


CASES = [
    Case("decode 64 x 4096, 32/8/128 bf16", *decode(64, 4096)),
    Case("  same, masks on every tile", *decode(64, 4096), tuning=LaunchTuning(skip_masks=False)),
    Case("  same, int64 offsets", *decode(64, 4096), tuning=LaunchTuning(narrow_offsets=False)),
    Case("decode 16 x 4096, 32/8/128 bf16 (split)", *decode(16, 4096)),
    Case("decode 64 x 4096, 9/3/64 bf16", *decode(64, 4096), q_heads=9, kv_heads=3, head_dim=64),
    Case("decode 64 x 4096, 9/3/64 fp32", *decode(64, 4096), 9, 3, 64, torch.float32),
    Case("prefill 4 x 2048, 32/8/128 bf16", (2048,) * 4, (2048,) * 4),
    Case("mixed, 9/3/128 fp16", (1, 1, 130), (700, 2000, 400), 9, 3, 128, torch.float16),
    Case("prefill over a prefix, 8/8/64 fp32", (300, 200), (300, 900), 8, 8, 64, torch.float32),
]


def matrix() -> list[Case]:
    """Every dtype, head dim 64 and 128, GQA 1, 3 and 8, and decode / prefill / mixed."""
    batches = {
        "decode": ((1,) * 8, (3000,) * 8),
        "prefill": ((300, 200), (300, 900)),
        "mixed": ((1, 1, 130), (700, 2000, 400)),
    }
    axes = itertools.product(TRITON_DTYPES, (64, 128), ((8, 8), (9, 3), (32, 4)), batches)
    return [
        Case(f"{kind} {q}/{kv}/{dim} {TRITON_DTYPES[dtype]}", *batches[kind], q, kv, dim, dtype)
        for dtype, dim, (q, kv), kind in axes
    ]


@dataclass
class Recorded:
    """One kernel launch as `launch_paged_attention` made it."""

    kernel: Any  # the triton JITFunction
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Recorder:
    """Stands where a @triton.jit kernel is indexed with its grid, and records the call."""

    def __init__(self, kernel: Any, calls: list[Recorded]) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def record(*args: Any, **kwargs: Any) -> None:
            self.calls.append(Recorded(self.kernel, grid, args, kwargs))

        return record


@contextmanager
def recording() -> Iterator[list[Recorded]]:
    calls: list[Recorded] = []
    names = ("_paged_attention_kernel", "_reduce_splits_kernel")
    real = {name: getattr(triton_attention, name) for name in names}
    try:
        for name, kernel in real.items():
            setattr(triton_attention, name, _Recorder(kernel, calls))
        yield calls
    finally:
        for name, kernel in real.items():
            setattr(triton_attention, name, kernel)


def record_attention(case: Case, num_sms: int) -> list[Recorded]:
    """The launches the backend makes for `case`, on meta tensors."""
    meta = torch.device("meta")
    num_seqs, num_tokens = len(case.seq_lens), sum(case.query_lens)
    max_blocks = math.ceil(max(case.seq_lens) / case.block_size)
    num_blocks = num_seqs * max_blocks + 1
    pool = torch.empty(
        (1, 2, num_blocks, case.block_size, case.kv_heads, case.head_dim),
        dtype=case.dtype,
        device=meta,
    )
    query = torch.empty((num_tokens, case.q_heads, case.head_dim), dtype=case.dtype, device=meta)
    launch = choose_launch(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        max_query_len=max(case.query_lens),
        max_seq_len=max(case.seq_lens),
        num_q_heads=case.q_heads,
        num_kv_heads=case.kv_heads,
        head_dim=case.head_dim,
        dtype=case.dtype,
        num_sms=num_sms,
        tuning=case.tuning,
    )
    with recording() as calls:
        triton_attention.launch_paged_attention(
            torch.empty_like(query),
            query,
            pool[0, 0],
            pool[0, 1],
            torch.empty((num_seqs, max_blocks), dtype=torch.int32, device=meta),
            torch.empty((num_seqs,), dtype=torch.int32, device=meta),
            torch.empty((num_seqs + 1,), dtype=torch.int32, device=meta),
            split_scratch(num_tokens, case.q_heads, case.head_dim, launch, meta),
            launch,
            case.head_dim**-0.5,
        )
    return calls


@dataclass
class Loop:
    instructions: int
    ops: collections.Counter[str]


@dataclass
class Compiled:
    kernel: str
    grid: tuple[int, ...]
    shared_bytes: int
    registers: int
    local_bytes: int
    loops: list[Loop] = field(default_factory=list)
    num_warps: int = 4
    num_stages: int = 3


def compile_for_sm90(call: Recorded, capability: int = SM90[0]) -> Compiled:
    """Compile the recorded launch for `capability` and read its SASS."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import native_specialize_impl

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    kernel = call.kernel
    kwargs = dict(call.kwargs)
    options: dict[str, Any] = {
        k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs
    }
    options["enable_fp_fusion"] = True  # the launch default, said out loud (Triton 3.9 warns)
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(kernel.arg_names):
        if name in kwargs:
            signature[name], constexprs[name] = "constexpr", kwargs[name]
            continue
        kind, attr = native_specialize_impl(type(backend), call.args[i], False, True, True)
        if kind == "constexpr":  # an integer 1, folded like the runtime folds it
            signature[name], constexprs[name] = "constexpr", attr
        else:
            signature[name] = kind
            if attr:
                attrs[(i,)] = backend.parse_attr(attr)
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=target, options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = _cuobjdump("-sass", cubin)
        usage = _cuobjdump("-res-usage", cubin)
    registers = int(re.search(r"REG:(\d+)", usage).group(1))  # type: ignore[union-attr]
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))  # type: ignore[union-attr]
    return Compiled(
        kernel=kernel.__name__,
        grid=call.grid,
        shared_bytes=int(compiled.metadata.shared),
        registers=registers,
        local_bytes=local,
        loops=loops_of(sass),
        num_warps=options.get("num_warps", 4),
        num_stages=options.get("num_stages", 3),
    )


def _cuobjdump(flag: str, cubin: Path) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    result = subprocess.run([str(tool), flag, str(cubin)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"cuobjdump {flag} failed: {result.stderr.strip()}")
    return result.stdout


def loops_of(sass: str) -> list[Loop]:
    """Each backward branch closes a loop; its body is the run of instructions it jumps over."""
    instructions: list[tuple[int, str]] = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            instructions.append((int(m.group(1), 16), m.group(2)))
    index = {address: i for i, (address, _) in enumerate(instructions)}
    loops = []
    for i, (address, text) in enumerate(instructions):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < address and int(m.group(1), 16) in index:
            body = instructions[index[int(m.group(1), 16)] : i + 1]
            ops = collections.Counter(_opcode(t) for _, t in body)
            loops.append(Loop(instructions=len(body), ops=ops))
    return loops


def _opcode(text: str) -> str:
    """`@!P0 LDGSTS.E.BYPASS.128 [R1], [R2.64]` -> `LDGSTS.E.BYPASS.128`."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def summarize(loop: Loop) -> str:
    def count(prefix: str) -> int:
        return sum(n for op, n in loop.ops.items() if op.startswith(prefix))

    kv_copies = count("LDGSTS.E.BYPASS.128")
    scalar_loads = count("LDG.E") - count("LDG.E.128")
    math_ops = count("HMMA") + count("HGMMA")
    return (
        f"{loop.instructions} instr: {kv_copies} LDGSTS.128, {count('LDGSTS') - kv_copies} "
        f"other LDGSTS, {scalar_loads} narrow LDG, {math_ops} MMA, {count('MUFU')} MUFU, "
        f"{count('BAR')} BAR"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, help="also write the table to this markdown file")
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    parser.add_argument("--matrix", action="store_true", help="compile every launch shape")
    args = parser.parse_args(argv)
    if triton_attention.INTERPRETER:
        parser.error("unset TRITON_INTERPRET: the interpreter replaces the kernels it compiles")
    if args.matrix:
        return compile_matrix()
    records: list[dict[str, Any]] = []
    lines = [
        f"Attention kernel compiled for sm_{SM90[0]} by Triton {triton.__version__} "
        f"(no GPU used); per thread, per loop iteration",
        "",
        "| case | grid | tile / warps / stages / splits | shared KiB | regs | spill B | loops |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for case in CASES:
        for call in record_attention(case, num_sms=SM90[1]):
            if call.kernel.__name__ != "_paged_attention_kernel":
                continue
            code = compile_for_sm90(call)
            kw = call.kwargs
            knobs = f"{kw['TILE_N']} / {code.num_warps} / {code.num_stages} / {kw['NUM_SPLITS']}"
            loops = "<br>".join(summarize(loop) for loop in code.loops)
            grid = "x".join(map(str, code.grid))
            row = (
                f"| {case.name} | {grid} | {knobs} | {code.shared_bytes / 1024:.1f} | "
                f"{code.registers} | {code.local_bytes} | {loops} |"
            )
            lines.append(row)
            print(row, flush=True)
            loop_figures = [
                {"instructions": x.instructions, "ops": dict(x.ops)} for x in code.loops
            ]
            figures = {f.name: getattr(code, f.name) for f in dataclasses.fields(code)}
            records.append({"case": case.name, **figures, "loops": loop_figures})
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps(records, indent=1))
    return 0


def compile_matrix() -> int:
    launches, problems, most_registers = 0, [], 0
    for case in matrix():
        for call in record_attention(case, num_sms=SM90[1]):
            launches += 1
            try:
                code = compile_for_sm90(call)
            except Exception as exc:  # report every failure, not just the first
                problems.append(f"{case.name}, {call.kernel.__name__}: {exc!r}"[:300])
                continue
            most_registers = max(most_registers, code.registers)
            if code.local_bytes:
                problems.append(f"{case.name}, {call.kernel.__name__}: spills {code.local_bytes} B")
    print(
        f"{launches} launches compiled for sm_{SM90[0]} by Triton {triton.__version__}: "
        f"{len(problems)} failed or spilled; at most {most_registers} registers per thread"
    )
    for problem in problems:
        print("  " + problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
