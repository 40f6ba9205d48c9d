"""Packed matmul weights: GGUF blocks, served as a file stores them, through the CPU kernels.

A `PackedWeight` is a projection's weight in ggml's block types (kernels/cpu/formats.py):
Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, with their fp16 scales and mins as stored, so a
served weight is the file's value exactly and takes the file's bytes in memory. A fused
projection (qkv, gate_up) whose parts a file stores in different types (Q4_K_M keeps V in
Q6_K) keeps one part per type.

Dense weights (a Hugging Face checkpoint, an F16 tensor, a GGUF type the kernels do not
read) are quantized when packed weights are asked for: to Q8_0 (`--weights int8`, and what
`auto` does with such a tensor in a packed GGUF) or Q4_1 (`--weights int4`), by gguf's own
quantizer, as llama.cpp's tools would.

The kernels compute in fp32: each weight dequantized in registers, then fp32 dot products
with fp32 inputs (native GEMV). A step of many rows instead dequantizes each weight into one
scratch buffer and runs torch's dense GEMM (`QuantLinear`, above its crossover).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.cpu import ops
from kernels.cpu.dispatch import KernelSet
from kernels.cpu.formats import REGROUPED, Blocks, WeightType
from kernels.cpu.structs import MAX_PARTS

# The packed formats, named by the dtype a config asks for them with, and the type a dense
# weight is quantized to in each.
INT4: torch.dtype = torch.uint4  # type: ignore[attr-defined]  # (missing from torch's stubs)
QUANTIZE_TO: dict[torch.dtype, WeightType] = {INT4: WeightType.Q4_1, torch.int8: WeightType.Q8_0}
# What the LM head and the embedding become where a packed model's are dense.
HEAD_TYPE = WeightType.Q8_0
NO_CROSSOVER = 1 << 30  # more rows than any step has: the native GEMV at every size
# Types gguf can quantize a dense weight into (the K types need llama.cpp's tools).
_QUANTIZABLE = (WeightType.Q4_0, WeightType.Q4_1, WeightType.Q5_0, WeightType.Q8_0)


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight [n, k] as one or more `Blocks` of one k whose outputs follow one another."""

    parts: tuple[Blocks, ...]

    def __post_init__(self) -> None:
        if not self.parts or len({p.k for p in self.parts}) != 1:
            raise ValueError("a packed weight is one or more block weights of one k")
        if len(self.parts) > MAX_PARTS:
            raise ValueError(f"at most {MAX_PARTS} parts of different types")

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.n for p in self.parts), self.parts[0].k)

    @property
    def kinds(self) -> tuple[WeightType, ...]:
        return tuple(dict.fromkeys(p.kind for p in self.parts))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def map_rows(self, fn: Callable[[Tensor], Tensor]) -> PackedWeight:
        """Apply a permutation of the rows (outputs), given as what it does to a dense weight:
        the blocks move with their rows, in place (this weight is consumed: a GGUF's rows
        are reordered in the private pages of its copy-on-write map, not copied off it)."""
        n = self.shape[0]
        index = fn(torch.arange(n, dtype=torch.int64)[:, None])[:, 0]
        if len(self.parts) != 1:
            raise ValueError("rows of a multi-part weight are not permuted")
        (blocks,) = self.parts
        if blocks.rows_x8:
            raise ValueError("rows regrouped eight at a time are not permuted")
        blocks.data.copy_(blocks.data.index_select(0, index))
        return self

    def regrouped(self, kernels: KernelSet) -> PackedWeight:
        """This weight with each part (of a type but Q5_0) of a multiple of 8 rows
        regrouped eight rows at a time, in place (formats.py, ROWS_X8): where the products
        take int8 inputs."""
        return PackedWeight(
            tuple(
                ops.regroup_rows_x8(kernels, p) if p.kind in REGROUPED and p.n % 8 == 0 else p
                for p in self.parts
            )
        )

    def dequantize(self) -> Tensor:
        """The dense fp32 weight, through gguf's own dequantization (the reference)."""
        return torch.cat([_gguf_dequantize(p) for p in self.parts])


Weight = Tensor | PackedWeight


def _gguf_dequantize(blocks: Blocks) -> Tensor:
    kind = gguf.GGMLQuantizationType(int(blocks.kind))
    return torch.from_numpy(np.array(gguf.quants.dequantize(blocks.stored().numpy(), kind)))


def dense(w: Weight) -> Tensor:
    return w if isinstance(w, Tensor) else w.dequantize()


def quantize(w: Tensor, kind: WeightType) -> PackedWeight:
    """A dense weight [n, k] in `kind`'s blocks, as llama.cpp's quantizer makes them."""
    if kind not in _QUANTIZABLE:
        raise ValueError(f"dense weights quantize to {[t.name for t in _QUANTIZABLE]} only")
    k = w.shape[1]
    array = w.detach().float().contiguous().numpy()
    data = gguf.quants.quantize(array, gguf.GGMLQuantizationType(int(kind)))
    return PackedWeight((Blocks(kind, torch.from_numpy(np.ascontiguousarray(data)), k),))


def cat_rows(parts: Sequence[Weight]) -> Weight:
    """Stack weights along the outputs (q, k, v into one qkv): dense ones into one tensor,
    packed ones as one part each, so that their blocks stay where they are (a GGUF's stay in
    its map: no copy); past `MAX_PARTS` parts, each run of a type is joined into one."""
    if all(isinstance(p, Tensor) for p in parts):
        return torch.cat([p for p in parts if isinstance(p, Tensor)])
    if not all(isinstance(p, PackedWeight) for p in parts):
        raise ValueError("stack packed weights with packed weights: quantize the dense ones")
    blocks = [b for p in parts if isinstance(p, PackedWeight) for b in p.parts]
    if len(blocks) <= MAX_PARTS:
        return PackedWeight(tuple(blocks))
    merged: list[Blocks] = []
    for b in blocks:
        if merged and (merged[-1].kind, merged[-1].rows_x8) == (b.kind, b.rows_x8):
            last = merged.pop()
            b = Blocks(b.kind, torch.cat([last.data, b.data]), b.k, b.rows_x8)
        merged.append(b)
    return PackedWeight(tuple(merged))


def map_rows(w: Weight, fn: Callable[[Tensor], Tensor]) -> Weight:
    return fn(w) if isinstance(w, Tensor) else w.map_rows(fn)


# NOTE: `matmul_inputs` auto gives int8 inputs to models of this many matmul parameters and
# more (a 0.5B model and up), fp32 to smaller ones. In a model of 1B and more the products are
# most of a step and int8's integer products 2-2.5x faster on K-quant weights (docs/perf.md,
# "int8 inputs"); a model of a few hundred million is fast either way, and its flat
# distributions hold near ties that int8 inputs flip (the bundled 135M model answers "What is
# the capital of France?" with "L'Etoile" under them, as llama.cpp does, "Paris" under fp32).
INT8_INPUTS_FROM_PARAMETERS = 400_000_000


def auto_matmul_inputs(parameters: int) -> str:
    """What `matmul_inputs` auto picks for a model of `parameters` matmul parameters."""
    return "int8" if parameters >= INT8_INPUTS_FROM_PARAMETERS else "fp32"


def matmul_parameters(weights: Mapping[str, Weight]) -> int:
    """Parameters of the matmul weights among `weights` (a model's, by our names): the 2-D
    ones, packed or dense; a tied embedding counted once, as the LM head it is."""
    total = 0
    for w in weights.values():
        if isinstance(w, PackedWeight):
            n, k = w.shape
            total += n * k
        elif w.dim() == 2:
            total += w.numel()
    return total


def weights_name(kinds: Sequence[WeightType]) -> str:
    """How /v1/stats and the logs name packed weights: their types, e.g. "Q4_K+Q6_K"."""
    return "+".join(sorted({k.name for k in kinds}, key=lambda name: WeightType[name]))


# -- modules -----------------------------------------------------------------------------------


class DequantScratch:
    """The one buffer a model's packed projections dequantize into on their dense path, in
    the dtype dense matmuls run fastest in on this CPU (bf16 with AVX512-BF16, else fp32).

    One per model, shared by its layers: the forward runs them one after another on one
    thread, and each consumes its weight (the GEMM reads it) before the next overwrites it.
    Capped, so the dense path never holds more than `max_elements` dequantized weights (the
    LM head's are cut into blocks of rows): the packed formats exist to keep weights small.
    """

    def __init__(self, dtype: torch.dtype, max_elements: int = 1 << 21) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the dense path runs in bf16 or fp32, not {dtype}")
        self.dtype = dtype
        self.max_elements = max_elements
        self._buffer = torch.empty(0, dtype=dtype)

    def take(self, *shape: int) -> Tensor:
        numel = math.prod(shape)
        if numel > self.max_elements:
            raise ValueError(f"a {shape} block is over the scratch's {self.max_elements}")
        if self._buffer.numel() < numel:
            self._buffer = torch.empty(numel, dtype=self.dtype)
        return self._buffer[:numel].view(*shape)


class QuantLinear(nn.Module):
    """A bias-free projection over a `PackedWeight`, through the CPU kernels `kernels`.

    NOTE: the kernel follows the batch where that pays. The native product reads each weight
    once: up to four rows in registers, more through tiles of dequantized rows in L1 (it beat
    torch's fp32 GEMM over the dequantized weight at every row count measured: docs/perf.md,
    "Every version side by side"). Where torch's GEMM wins above some row count on a CPU, steps
    of more than `max_packed_tokens` rows dequantize each weight into `scratch` and run it
    (`packed_kernel_pays`; the crossover is timed once per process and thread count,
    `measured_max_packed_tokens`). No dense copy is ever kept.
    """

    def __init__(
        self,
        weight: PackedWeight,
        kernels: KernelSet,
        *,
        scratch: DequantScratch | None = None,
        max_packed_tokens: int = NO_CROSSOVER,
        threads: int = 1,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.kernels = kernels
        self.scratch = scratch
        self.max_packed_tokens = max_packed_tokens
        # 2: the native product's rows split with the library's helper thread (where free)
        self.threads = threads

    @property
    def kinds(self) -> tuple[WeightType, ...]:
        return self.weight.kinds

    @property
    def max_dense_rows(self) -> int:
        """The most output rows one dequantized block holds."""
        assert self.scratch is not None
        return min(self.out_features, max(self.scratch.max_elements // self.in_features, 1))

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, in] -> [T, out]
        if self.scratch is not None and not packed_kernel_pays(x.shape[0], self.max_packed_tokens):
            dense: Tensor = self._dense(x.to(self.scratch.dtype)).to(x.dtype)
            return dense
        y = ops.gemv_threads(self.kernels, self.weight.parts, x.float(), self.threads)
        return y.to(x.dtype)

    def _dense(self, x: Tensor) -> Tensor:
        # x: [T, in] in the scratch's dtype -> [T, out], a block of weight rows at a time
        step = self.max_dense_rows
        if step >= self.out_features:
            return F.linear(x, self._dequantize(0, self.out_features))
        y_t = torch.empty(self.out_features, x.shape[0], dtype=x.dtype)  # [out, T]
        for begin in range(0, self.out_features, step):
            end = min(begin + step, self.out_features)
            torch.mm(self._dequantize(begin, end), x.t(), out=y_t[begin:end])
        return y_t.t().contiguous()

    def _dequantize(self, begin: int, end: int) -> Tensor:
        """Weight rows [begin, end) as a dense [end - begin, in] block in the scratch."""
        assert self.scratch is not None
        block = self.scratch.take(end - begin, self.in_features)
        offset = 0
        for part in self.weight.parts:
            first, last = max(begin, offset), min(end, offset + part.n)
            if first < last:
                rows = block[first - begin : last - begin]
                ops.dequantize(self.kernels, part, (first - offset, last - offset), rows)
            offset += part.n
        return block

    def extra_repr(self) -> str:
        dense = "" if self.scratch is None else f", dense above {self.max_packed_tokens} rows"
        kinds = weights_name(self.kinds)
        return f"in={self.in_features}, out={self.out_features}, {kinds}{dense}"


class PackedEmbedding(nn.Module):
    """Token embeddings looked up in a packed weight (the tied LM head's own when the model
    ties them, so the table is held once, at its file size)."""

    def __init__(self, weight: Blocks, kernels: KernelSet, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.kernels = kernels
        self.dtype = dtype

    def forward(self, ids: Tensor) -> Tensor:
        # ids: [T] int64 -> [T, D] in `dtype`
        return ops.dequantize_rows(self.kernels, self.weight, ids).to(self.dtype)


# -- which kernel for how many rows ------------------------------------------------------------


def packed_kernel_pays(num_tokens: int, max_packed_tokens: int) -> bool:
    """The packed kernel for a step of `num_tokens` rows, the dense path above the crossover."""
    return num_tokens <= max_packed_tokens


TRIAL_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # 512: a prefill chunk


# How much faster the dense path must be to take a step from the native product: a near tie
# goes to the native product, which splits with the helper thread and keeps no scratch.
DENSE_MARGIN = 1.1


def pick_max_packed_tokens(times: dict[int, tuple[float, float]]) -> int:
    """From {rows: (packed seconds, dense seconds)}: the most rows up to which the packed
    kernel was never clearly slower (by `DENSE_MARGIN`) at every measured size (0: never).
    Kernel times grow with the rows and the packed kernel's faster (it reads less, then
    computes more per row), so one crossover; a size where it lost ends the run even if a
    larger one looks faster (noise)."""
    best = 0
    for rows in sorted(times):
        packed, dense_ = times[rows]
        if packed >= DENSE_MARGIN * dense_:
            break
        best = rows
    return best


def measured_max_packed_tokens(
    layer: Sequence[PackedWeight], kernels: KernelSet, dense_dtype: torch.dtype, threads: int = 1
) -> int:
    """Time one decoder layer's projections (`layer`, the model's own), the native product
    on `threads` threads against the dense path (dequantize to `dense_dtype`, then torch's
    GEMM on torch's threads), at each of `TRIAL_ROWS`; pick the crossover with
    `pick_max_packed_tokens`. About a second, once per process for each layer shape, kernel
    choice, dtype and thread counts."""
    key = (
        tuple((w.shape, w.kinds) for w in layer),
        tuple(kernels.chosen.items()),
        dense_dtype,
        threads,
        torch.get_num_threads(),
    )
    if key not in _CROSSOVERS:
        times = crossover_trial(layer, kernels, dense_dtype, threads)
        _CROSSOVERS[key] = pick_max_packed_tokens(times)
    return _CROSSOVERS[key]


_CROSSOVERS: dict[tuple[object, ...], int] = {}


def crossover_trial(
    layer: Sequence[PackedWeight], kernels: KernelSet, dense_dtype: torch.dtype, threads: int = 1
) -> dict[int, tuple[float, float]]:
    """{rows: (packed seconds, dense-path seconds)} for one decoder layer's projections."""
    scratch = DequantScratch(dense_dtype)
    packed = [QuantLinear(w, kernels, threads=threads) for w in layer]
    dense_ = [QuantLinear(w, kernels, scratch=scratch, max_packed_tokens=0) for w in layer]
    return {rows: _race(rows, packed, dense_) for rows in TRIAL_ROWS}


class _Matmul(Protocol):
    in_features: int

    def __call__(self, x: Tensor) -> Tensor: ...


def _race(rows: int, first: Sequence[_Matmul], second: Sequence[_Matmul]) -> tuple[float, float]:
    """Best-of-five seconds of each layer's matmuls on `rows` fp32 rows, alternating, so a
    neighbour's load falls on both. Wall time: a thread's own CPU time would not count the
    helper thread's half of a split product."""
    clock = time.perf_counter
    gen = torch.Generator().manual_seed(rows)
    inputs = {m.in_features: torch.randn(rows, m.in_features, generator=gen) for m in first}
    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        for _ in range(5):
            for i, layer in enumerate((first, second)):
                start = clock()
                for m in layer:
                    m(inputs[m.in_features])
                best[i] = min(best[i], clock() - start)
    return best[0], best[1]
