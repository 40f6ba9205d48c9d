"""Builds the CPU kernel library: every kernel once per instruction set, one shared library.

The per-ISA sources (PER_ISA_SOURCES) are compiled once for each version of this
architecture with that version's flags and `-DPC_ISA=<name>`, which suffixes every exported
name (`pc_gemv_avx2`); the rest (ONCE_SOURCES: stack.c and its parts, features.c, rows_x8.c,
abi.c) once, for the baseline. Nothing is compiled for the machine that builds it (no
-march=native): the same file runs on every CPU of the architecture, and
kernels/cpu/dispatch.py picks the versions when it loads.

Only the standard library here: the Dockerfile's build stage runs it without torch
(`python -m kernels.cpu.build --output libpagechat_cpu.so`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).with_name("src")
PER_ISA_SOURCES = (
    "quants.c", "products_q8.c", "tiles_q8.c", "attention.c", "ops.c", "sample.c",
)  # fmt: skip
ONCE_SOURCES = ("stack.c", "helper.c", "context_views.c", "features.c", "rows_x8.c", "abi.c")
HEADERS = (
    "pagechat_cpu.h",
    "simd.h",
    "blocks.h",
    "int8.h",
    "weights_q8.h",
    "rows_x8.h",
    "stack_parts.h",
)  # harness.c, a test program, is not in the library
# -ffp-contract=off: a * b + c is fused only where the source says so (vf_fma), never where the
# compiler's unrolling happens to find it, so that a row's sums are the same bits in every
# specialization of a loop (one input row and several took different roundings with it on).
# -fno-trapping-math: no kernel reads the FP exception flags, and without it GCC keeps a clamp
# or a floor from being vectorized (the softmax's exp ran one element at a time); it changes
# no value.
COMMON_FLAGS = (
    "-O3", "-fPIC", "-std=gnu11", "-pthread", "-fno-math-errno", "-fno-trapping-math",
    "-ffp-contract=off",
)  # fmt: skip


# vnni's level with Intel's tile unit (AMX-TILE, AMX-BF16, AMX-INT8): the products of many rows
# (quants.c's fp32 inputs in bf16, tiles_q8.c's int8 inputs)
AMX_FLAGS = ("-march=x86-64-v4", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8")


@dataclass(frozen=True, slots=True)
class Isa:
    """One version of the kernels: its name (the symbols' suffix), its compiler flags, and
    the macro simd.h selects its vocabulary by."""

    name: str
    flags: tuple[str, ...]
    macro: str


# Each architecture's versions, from the baseline up: dispatch.py prefers the last one the
# CPU can run (features.c says which).
ISAS: dict[str, tuple[Isa, ...]] = {
    "x86_64": (
        Isa("generic", ("-march=x86-64", "-mtune=generic"), "PC_ISA_GENERIC"),
        Isa("avx2", ("-march=x86-64-v3", "-mtune=generic"), "PC_ISA_AVX2"),
        Isa("avx512", ("-march=x86-64-v4", "-mtune=generic"), "PC_ISA_AVX512"),
        Isa("vnni", ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"), "PC_ISA_VNNI"),
        Isa("amx", (*AMX_FLAGS, "-mtune=generic"), "PC_ISA_AMX"),
    ),
    "aarch64": (
        Isa("generic", ("-march=armv8-a",), "PC_ISA_GENERIC"),
        Isa("neon", ("-march=armv8.2-a+dotprod",), "PC_ISA_NEON"),
    ),
}


def machine() -> str:
    """This process's architecture as ISAS names it."""
    name = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


def isas(arch: str) -> tuple[Isa, ...]:
    if arch not in ISAS:
        raise ValueError(f"no kernel versions for {arch!r} (only {sorted(ISAS)})")
    return ISAS[arch]


def compile_commands(
    compiler: str, arch: str, out_dir: Path, extra: tuple[str, ...] = ()
) -> list[list[str]]:
    """One command per object: the per-ISA sources once per version, the rest once (`extra`
    flags added to each: warnings, sanitizers)."""
    include = f"-I{SOURCE_DIR}"
    commands = []
    for isa in isas(arch):
        for source in PER_ISA_SOURCES:
            target = out_dir / f"{Path(source).stem}_{isa.name}.o"
            defines = (f"-D{isa.macro}=1", f"-DPC_ISA={isa.name}")
            commands.append(
                [compiler, *COMMON_FLAGS, *extra, *isa.flags, *defines, include, "-c",
                 str(SOURCE_DIR / source), "-o", str(target)]
            )  # fmt: skip
    baseline = isas(arch)[0].flags
    for source in ONCE_SOURCES:
        target = out_dir / f"{Path(source).stem}.o"
        commands.append(
            [compiler, *COMMON_FLAGS, *extra, *baseline, include, "-c",
             str(SOURCE_DIR / source), "-o", str(target)]
        )  # fmt: skip
    return commands


def objects(commands: list[list[str]]) -> list[str]:
    return [command[command.index("-o") + 1] for command in commands]


def source_key(compiler: str, arch: str) -> str:
    """What decides the library's bytes: the sources, the flags and the compiler's version."""
    digest = hashlib.sha256()
    for name in (*PER_ISA_SOURCES, *ONCE_SOURCES, *HEADERS):
        digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    for command in compile_commands("cc", arch, Path("/")):
        digest.update(" ".join(command[1:]).encode())
    digest.update(version.encode() + arch.encode())
    return digest.hexdigest()[:16]


def build(compiler: str, output: Path, arch: str | None = None, jobs: int = 2) -> Path:
    """Compile every object (`jobs` at a time) and link them into `output`, written beside
    it and renamed, so that a concurrent start never loads half a file."""
    arch = arch or machine()
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent) as work:
        commands = compile_commands(compiler, arch, Path(work))
        _run_all(commands, jobs)
        tmp = Path(work) / output.name
        subprocess.run(
            [compiler, "-shared", "-pthread", "-o", str(tmp), *objects(commands), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(tmp, output)
    return output


def build_harness(
    compiler: str, output: Path, arch: str, jobs: int = 2, sanitize: bool = False
) -> Path:
    """The kernels with harness.c as one program (src/harness.c says what it runs): static,
    for an architecture this process cannot load a library of, run under qemu-user; or, with
    `sanitize`, for this one under AddressSanitizer and UBSan (every access checked)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    extra = SANITIZERS if sanitize else ()
    with tempfile.TemporaryDirectory(dir=output.parent) as work:
        commands = compile_commands(compiler, arch, Path(work), extra)
        harness = Path(work) / "harness.o"
        include = f"-I{SOURCE_DIR}"
        baseline = isas(arch)[0].flags
        commands.append(
            [compiler, *COMMON_FLAGS, *extra, *baseline, include, "-c",
             str(SOURCE_DIR / "harness.c"), "-o", str(harness)]
        )  # fmt: skip
        _run_all(commands, jobs)
        link = [*extra] if sanitize else ["-static"]
        subprocess.run(
            [compiler, *link, "-pthread", "-o", str(output), *objects(commands), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
    return output


SANITIZERS = (
    "-O1",  # after COMMON_FLAGS' -O3: the checks are the same, and the kernels compile in a
    # fifth of the time (the int8 tiles' unrolled loops took 25 s a version at -O3)
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
)
WARNINGS = ("-Wall", "-Wextra", "-Wshadow", "-Wmissing-prototypes", "-Werror")


def _run_all(commands: list[list[str]], jobs: int) -> None:
    running: list[subprocess.Popen[bytes]] = []
    pending = list(commands)
    while pending or running:
        while pending and len(running) < max(jobs, 1):
            running.append(
                subprocess.Popen(pending.pop(0), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            )
        process = running.pop(0)
        _, err = process.communicate(timeout=300)
        if process.returncode:
            for other in running:
                other.kill()
            raise subprocess.CalledProcessError(process.returncode, process.args, stderr=err)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--compiler", default=os.environ.get("CC", "cc"))
    parser.add_argument("--arch", default=machine(), choices=sorted(ISAS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print(build(args.compiler, args.output, args.arch, args.jobs))


if __name__ == "__main__":
    main()
