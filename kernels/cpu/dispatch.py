"""Which version of each CPU kernel runs: chosen when a process first asks, from what this
CPU can execute, kernel by kernel.

`select("auto")` takes the best version this CPU runs (features.c: x86-64-v3 for avx2,
x86-64-v4 for avx512, AVX512-VNNI on top for vnni, AMX-TILE and AMX-BF16 with Linux's leave
to use them for amx; NEON with dot products for neon) or,
where $PAGECHAT_CPU_ISA names one, that version; `select("avx2")` forces one (refused where
the CPU cannot run it). Each kernel's version is then probed against the generic version on
small random inputs: a version that disagrees is not used, that kernel alone falls back to
the next version down, and a warning says which and why. The rest keep theirs.

`select(isa, matmul_inputs="int8")` is the same choice with the packed products taking their
inputs as int8 (products_q8.c, `gemv_q8`) wherever the table says `gemv`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels.cpu import build, ops
from kernels.cpu.formats import REGROUPED, Blocks, WeightType, random_blocks
from kernels.cpu.library import library
from kernels.cpu.structs import INT8_TABLE_FIELDS, STACK_KERNELS, CKernels

log = logging.getLogger(__name__)

# Every kernel with a version per ISA.
KERNELS = (
    *STACK_KERNELS, "dequant", "dequant_rows", "sample", "gemv_q8", "quantize_q8", "gemv_rowwise",
)  # fmt: skip
# What the packed products take as inputs: fp32 as they are (the dequantized model's
# arithmetic), or int8 per 32 inputs (`gemv_q8` in `gemv`'s place).
MATMUL_INPUTS = ("fp32", "int8")


# The int8 products' entry points filling pc_kernels' INT8_TABLE_FIELDS (NULL with fp32
# inputs): one version for all three, gemv_q8's (an input prepared by one version is read by
# its own).
INT8_ENTRIES = ("q8_prepared_bytes", "q8_prepare", "gemv_q8_prepared")


def names() -> tuple[str, ...]:
    """The versions of this architecture, from the baseline up."""
    return tuple(isa.name for isa in build.isas(build.machine()))


@dataclass(frozen=True, eq=False)
class KernelSet:
    """One version of each kernel, and why: what `ops` calls and the decode stack reads."""

    lib: ctypes.CDLL
    chosen: Mapping[str, str]  # kernel -> the version that runs it
    runnable: tuple[str, ...] = ()  # the versions this CPU runs
    fallbacks: tuple[str, ...] = ()  # a line per kernel that fell back, saying why
    matmul_inputs: str = "fp32"  # one of MATMUL_INPUTS
    # Each row's products the same bits whatever else a call holds: fp32 inputs a few rows
    # at a time (gemv_rowwise); int8 inputs are so on every path.
    batch_invariant: bool = False
    _table: list[CKernels] = field(default_factory=list, repr=False, init=False)

    @property
    def isa(self) -> str:
        """The version asked for: the one most kernels run."""
        values = list(self.chosen.values())
        return max(set(values), key=lambda isa: (values.count(isa), names().index(isa)))

    def fn(self, kernel: str) -> Any:
        if kernel == "gemv" and self.matmul_inputs == "int8":
            kernel = "gemv_q8"
        elif kernel == "gemv" and self.batch_invariant:
            kernel = "gemv_rowwise"
        return getattr(self.lib, f"pc_{kernel}_{self.chosen[kernel]}")

    @property
    def table(self) -> CKernels:
        if not self._table:
            addresses = {k: ctypes.cast(self.fn(k), ctypes.c_void_p).value for k in STACK_KERNELS}
            if self.matmul_inputs == "int8":
                isa = self.chosen["gemv_q8"]
                for field_name, entry in zip(INT8_TABLE_FIELDS, INT8_ENTRIES, strict=True):
                    fn = getattr(self.lib, f"pc_{entry}_{isa}")
                    addresses[field_name] = ctypes.cast(fn, ctypes.c_void_p).value
            self._table.append(CKernels(**addresses))
        return self._table[0]

    def with_matmul_inputs(self, matmul_inputs: str) -> KernelSet:
        """The same versions, their products taking `matmul_inputs` (one of MATMUL_INPUTS)."""
        if matmul_inputs not in MATMUL_INPUTS:
            raise ValueError(f"matmul inputs {matmul_inputs!r}: one of {MATMUL_INPUTS}")
        return _with_inputs(self, matmul_inputs)

    def with_batch_invariance(self, on: bool = True) -> KernelSet:
        """The same versions, each row's products computed as if alone (`batch_invariant`)."""
        return _with_invariance(self, on)

    def describe(self) -> str:
        """For the start-up log and /v1/stats: the version, and any kernel that differs."""
        others = [f"{k} {isa}" for k, isa in self.chosen.items() if isa != self.isa]
        inputs = ", int8 inputs" if self.matmul_inputs == "int8" else ""
        invariant = ", batch-invariant" if self.batch_invariant else ""
        return self.isa + (f" ({', '.join(others)})" if others else "") + inputs + invariant


def cpu_description() -> str:
    """This CPU as a measured figure should name it: its model and the kernel versions it
    runs ("AMD EPYC, x86_64: generic avx2 avx512 vnni")."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model name", "CPU part")):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    lib = library()
    runs = [n for n in names() if lib is not None and lib.pc_cpu_runs(n.encode())]
    return f"{model}, {build.machine()}: {' '.join(runs) or 'no CPU kernels'}"


def uniform(lib: ctypes.CDLL, isa: str) -> KernelSet:
    """Every kernel at `isa`, unprobed: for probes and tests."""
    return KernelSet(lib, dict.fromkeys(KERNELS, isa))


def requested_isa(isa: str = "auto") -> str:
    """`isa`, where "auto" defers to $PAGECHAT_CPU_ISA when that is set."""
    if isa == "auto":
        return os.environ.get("PAGECHAT_CPU_ISA", "").strip() or "auto"
    return isa


def select(isa: str = "auto", matmul_inputs: str = "fp32") -> KernelSet | None:
    """The kernels for `isa` (auto: the best this CPU runs), each probed, their products
    taking `matmul_inputs`; None where there is no library and `isa` is auto. A version this
    CPU cannot run, or one this architecture does not have, is a ValueError; so is a forced
    version without the library."""
    chosen = _select(requested_isa(isa))
    return None if chosen is None else chosen.with_matmul_inputs(matmul_inputs)


@functools.cache
def _with_inputs(kernels: KernelSet, matmul_inputs: str) -> KernelSet:
    """One KernelSet per choice and inputs (each builds its own table once)."""
    if matmul_inputs == kernels.matmul_inputs:
        return kernels
    return dataclasses.replace(kernels, matmul_inputs=matmul_inputs)


@functools.cache
def _with_invariance(kernels: KernelSet, on: bool) -> KernelSet:
    if on == kernels.batch_invariant:
        return kernels
    return dataclasses.replace(kernels, batch_invariant=on)


@functools.cache
def _select(isa: str) -> KernelSet | None:
    lib = library()
    if isa != "auto" and isa not in names():
        raise ValueError(f"unknown CPU kernel version {isa!r}: auto or one of {names()}")
    if lib is None:
        if isa == "auto":
            return None
        raise ValueError(f"cpu_isa {isa} asked for, but the CPU kernels are not available")
    runnable = tuple(name for name in names() if lib.pc_cpu_runs(name.encode()))
    target = runnable[-1] if isa == "auto" else isa
    if target not in runnable:
        raise ValueError(f"this CPU cannot run the {target} kernels (it runs {runnable})")
    candidates = runnable[: runnable.index(target) + 1][::-1]  # from the target down
    reference = uniform(lib, "generic")
    chosen: dict[str, str] = {}
    fallbacks: list[str] = []
    for kernel in KERNELS:
        for candidate in candidates:
            if candidate == "generic":
                chosen[kernel] = candidate
                break
            problem = PROBES[kernel](uniform(lib, candidate), reference)
            if problem is None:
                chosen[kernel] = candidate
                break
            line = f"the {candidate} {kernel} kernel disagrees with the generic one: {problem}"
            log.warning("%s; it runs the next version down", line)
            fallbacks.append(line)
    return KernelSet(lib, chosen, runnable, tuple(fallbacks))


# -- probes: each version against the generic one on small random inputs --------------------
# A probe returns None where the version agrees, else what differed.

Probe = Callable[[KernelSet, KernelSet], str | None]


def _differs(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float) -> str | None:
    error = (got.double() - want.double()).abs()
    if torch.isnan(got).any() or bool((error > bound).any()):
        return (
            f"off by {float(error.max()):.3g} where {float(torch.as_tensor(bound).max()):.3g} holds"
        )
    return None


def _probe_gemv(version: KernelSet, generic: KernelSet) -> str | None:
    gen = torch.Generator().manual_seed(0)
    for kind in WeightType:
        k = 2 * (256 if kind >= WeightType.Q4_K else 32)
        weight = random_blocks(kind, 8, k, gen)
        dense = ops.dequantize(generic, weight, (0, 8), torch.empty(8, k))
        # products in registers, through a dequantized row, and (amx) through the tile unit,
        # whose three bf16 products keep within 2^-16 of |x| |w| where fp32's keep 1e-7
        for m in (1, 5, 40):
            x = torch.randn(m, k, generator=gen)
            bound = 4e-5 * (x.abs().double() @ dense.abs().double().t()) + 1e-30
            problem = _differs(ops.gemv(version, weight, x), ops.gemv(generic, weight, x), bound)
            if problem:
                return f"{kind.name}, {m} rows: {problem}"
    return None


def _probe_gemv_rowwise(version: KernelSet, generic: KernelSet) -> str | None:
    """Each row of a many-row call the same bits as that row alone (the values themselves are
    gemv's, probed above)."""
    rowwise = version.with_batch_invariance()
    gen = torch.Generator().manual_seed(3)
    for kind in WeightType:
        k = 2 * (256 if kind >= WeightType.Q4_K else 32)
        weight = random_blocks(kind, 8, k, gen)
        x = torch.randn(9, k, generator=gen)
        together = ops.gemv(rowwise, weight, x)
        alone = torch.cat([ops.gemv(rowwise, weight, x[r : r + 1]) for r in range(9)])
        if not torch.equal(together, alone):
            return f"{kind.name}: a row of nine differs from itself alone"
    return None


def _probe_gemv_q8(version: KernelSet, generic: KernelSet) -> str | None:
    gen = torch.Generator().manual_seed(8)
    for kind in WeightType:
        k = 2 * (256 if kind >= WeightType.Q4_K else 32)
        weight = random_blocks(kind, 8, k, gen)
        dense = ops.dequantize(generic, weight, (0, 8), torch.empty(8, k))
        # the same int8 inputs and integer products: only the fp32 sums' rounding may differ
        for m in (1, 5, 40):
            x = torch.randn(m, k, generator=gen)
            bound = 1e-5 * (x.abs().double() @ dense.abs().double().t()) + 1e-30
            got, want = ops.gemv_q8(version, weight, x), ops.gemv_q8(generic, weight, x)
            if problem := _differs(got, want, bound):
                return f"{kind.name}, {m} rows: {problem}"
            if kind in REGROUPED:  # and its rows regrouped eight at a time (ROWS_X8)
                x8 = ops.regroup_rows_x8(version, Blocks(kind, weight.data.clone(), k))
                if problem := _differs(ops.gemv_q8(version, x8, x), want, bound):
                    return f"{kind.name} regrouped, {m} rows: {problem}"
    return None


def _probe_quantize_q8(version: KernelSet, generic: KernelSet) -> str | None:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 96, generator=gen) * torch.logspace(-3, 3, 96)
    x[1, 40] = float("inf")
    parts = ("values", "scales", "sums per 32", "sums per 16")
    got, want = ops.quantize_q8(version, x), ops.quantize_q8(generic, x)
    for part, mine, theirs in zip(parts, got, want, strict=True):
        if not torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)):
            return f"not the same {part}"
    return None


def _probe_dequant(version: KernelSet, generic: KernelSet) -> str | None:
    gen = torch.Generator().manual_seed(1)
    for kind in WeightType:
        k = 256 if kind >= WeightType.Q4_K else 64
        weight = random_blocks(kind, 4, k, gen)
        for dtype in (torch.float32, torch.bfloat16):
            got = ops.dequantize(version, weight, (1, 4), torch.empty(3, k, dtype=dtype))
            if not torch.equal(got, ops.dequantize(generic, weight, (1, 4), torch.empty_like(got))):
                return f"{kind.name} to {dtype}: not the same values"
    return None


def _probe_dequant_rows(version: KernelSet, generic: KernelSet) -> str | None:
    gen = torch.Generator().manual_seed(2)
    ids = torch.tensor([3, 0, 3])
    for kind in WeightType:
        weight = random_blocks(kind, 4, 256, gen)
        got = ops.dequantize_rows(version, weight, ids)
        if not torch.equal(got, ops.dequantize_rows(generic, weight, ids)):
            return f"{kind.name}: not the same values"
    return None


def _probe_cache(dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = torch.randn(2, 8, 4, 2, 32, generator=gen).to(dtype).unbind(0)  # [N, bs, Hkv, D]
    return k.contiguous(), v.contiguous()


def _probe_attend(version: KernelSet, generic: KernelSet) -> str | None:
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(2, 4, 32, generator=gen)
    slots = torch.randperm(32, generator=gen)[:24].view(2, 12)
    lens = torch.tensor([12, 5])
    for dtype in ops.ELEMENT_TYPES:
        k, v = _probe_cache(dtype, gen)
        got = ops.paged_decode(version, query, k, v, slots, lens, 0.2)
        want = ops.paged_decode(generic, query, k, v, slots, lens, 0.2)
        if problem := _differs(got, want, 1e-5 * float(v.float().abs().max())):
            return f"{dtype} cache: {problem}"
    return None


def _probe_rope_write(version: KernelSet, generic: KernelSet) -> str | None:
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(3, 8 * 32, generator=gen)  # 4 query heads, 2 KV heads of 32
    cos, sin = torch.randn(2, 3, 32, generator=gen).unbind(0)
    slots = torch.tensor([5, 17, 30])
    for dtype in ops.ELEMENT_TYPES:
        results = []
        for kernels in (version, generic):
            rows = qkv.clone()
            k, v = (torch.zeros(8, 4, 2, 32, dtype=dtype) for _ in range(2))
            ops.rope_write(kernels, rows, 4, cos.contiguous(), sin.contiguous(), slots, k, v)
            results.append((rows, k.float(), v.float()))
        (rows, k, v), (rows0, k0, v0) = results
        for got, want, what in ((rows, rows0, "q and k"), (k, k0, "K"), (v, v0, "V")):
            tolerance = 1e-5 if dtype == torch.float32 or what == "q and k" else 1e-2
            if problem := _differs(got, want, tolerance * (1 + want.abs())):
                return f"{what} in a {dtype} cache: {problem}"
    return None


def _probe_rms_norm(version: KernelSet, generic: KernelSet) -> str | None:
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 101, generator=gen), torch.randn(101, generator=gen)
    want = ops.rms_norm(generic, x, w, 1e-5)
    return _differs(ops.rms_norm(version, x, w, 1e-5), want, 1e-5 * (1 + want.abs()))


def _probe_silu_mul(version: KernelSet, generic: KernelSet) -> str | None:
    gen = torch.Generator().manual_seed(6)
    gate_up = torch.randn(3, 2 * 40, generator=gen) * 4
    want = ops.silu_mul(generic, gate_up)
    return _differs(ops.silu_mul(version, gate_up), want, 1e-5 * (1 + want.abs()))


def _probe_gelu_tanh_mul(version: KernelSet, generic: KernelSet) -> str | None:
    gen = torch.Generator().manual_seed(10)
    gate_up = torch.randn(3, 2 * 40, generator=gen) * 4
    want = ops.gelu_tanh_mul(generic, gate_up)
    return _differs(ops.gelu_tanh_mul(version, gate_up), want, 1e-5 * (1 + want.abs()))


def _probe_sample(version: KernelSet, generic: KernelSet) -> str | None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 300, generator=gen) * 3
    allowed = torch.randint(-(2**31), 2**31, (6, 10), generator=gen, dtype=torch.int64)
    allowed = allowed.to(torch.int32)
    allowed[1] = -1
    allowed[2, 3:] = 0  # ids past 96 forbidden
    temps = torch.tensor([1.0, 0.7, 0.0, 1.5, 1.0, 0.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0])
    for _ in range(4):
        uniforms = torch.rand(6, generator=gen, dtype=torch.float64)
        got = ops.sample(version, logits, allowed, temps, min_p, uniforms)
        want = ops.sample(generic, logits, allowed, temps, min_p, uniforms)
        if not torch.equal(got, want):
            return f"drew {got.tolist()} where the generic version drew {want.tolist()}"
    return None


PROBES: dict[str, Probe] = {
    "gemv": _probe_gemv,
    "gemv_q8": _probe_gemv_q8,
    "gemv_rowwise": _probe_gemv_rowwise,
    "quantize_q8": _probe_quantize_q8,
    "dequant": _probe_dequant,
    "dequant_rows": _probe_dequant_rows,
    "attend": _probe_attend,
    "rope_write": _probe_rope_write,
    "rms_norm": _probe_rms_norm,
    "silu_mul": _probe_silu_mul,
    "gelu_tanh_mul": _probe_gelu_tanh_mul,
    "sample": _probe_sample,
}
