"""Weight-only quantized matmul weights: GGUF blocks mapped onto torch's packed CPU kernels.

Two formats, each the layout one of torch's weight-only kernels reads:

- int4 (`Int4Weight`): w[n, k] = scale[n, g] * (q[n, k] - 8) + zero[n, g], q in 0..15, one
  (scale, zero) pair per group of 32 along k (g = k // 32). This is
  `_weight_int4pack_mm_for_cpu`'s dequantization (torch's own test, `_group_quantize_tensor`,
  builds it the same way); the kernel takes q packed by `_convert_weight_to_int4pack_for_cpu`
  and the pairs as `scales_and_zeros` [K/32, N, 2].
- int8 (`Int8Weight`): w[n, k] = scale[n] * q[n, k], q int8, one scale per output row: what
  `_weight_int8pack_mm` reads.

On a CPU with AVX512-VNNI, int4 weights are packed in pagechat's VNNI layout instead (the same
values and pairs; kernels/native.c says how) and run the native kernel, whose input goes in as
two int8 digits per group of 32, and the native decode stack (model.native_decoder_stack).

How the GGUF types map (blocks of 32 along a row, each with an fp16 scale d):
- Q4_0: w = d * (q - 8)                        -> int4, scale d, zero 0: exact.
- Q4_1: w = d * q + m = d * (q - 8) + (m + 8d) -> int4, scale d, zero m + 8d: exact (in fp32).
- Q4_K: super-blocks of 256 with fp16 d, dmin and six-bit (sc, m) per block of 32:
  w = d sc q - dmin m = d sc (q - 8) + (8 d sc - dmin m) -> int4, scale d sc, zero
  8 d sc - dmin m: the same values (`_q4_k_int4`).
- Q8_0: w = d * q with one d per block; the int8 kernel has one scale per row, so the row is
  requantized: scale = max|w| / 127 over the row. Not exact: off by at most scale / 2.
Any other type is dequantized by gguf and quantized like a Hugging Face weight.

The kernels are vectorized for bf16 inputs only (on an AVX2 EPYC, fp32 inputs ran the int4
kernel ~17x slower than bf16 ones), so they run in bf16: the input, the scales and zeros, and
the output are rounded to bf16 (8 significant bits). Per output, against the same matmul over
the exactly dequantized weights in fp32, that is at most ~3 * 2^-9 relative to sum_k |x_k w_k|
(the input's, the scale's and the zero's rounding; the output's adds 2^-9 of |y|).
"""

from __future__ import annotations

import functools
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

from kernels import native

GROUP_SIZE = 32  # int4 group along k; GGUF's Q4_0/Q4_1/Q8_0 block size too
KERNEL_DTYPE = torch.bfloat16  # the dtype the packed kernels are vectorized for
# The packed formats, named by the dtype a config asks for them with: bits per weight.
INT4: torch.dtype = torch.uint4  # type: ignore[attr-defined]  # (missing from torch's stubs)
PACKED_BITS = {INT4: 4, torch.int8: 8}
# _convert_weight_to_int4pack_for_cpu's inner k tiles; the CPU layout does not depend on it.
_INNER_K_TILES = 2


@dataclass(slots=True)
class Int4Weight:
    """w[n, k] = scale[n, k // 32] * (q[n, k] - 8) + zero[n, k // 32]; rows are outputs."""

    q: Tensor  # [N, K] uint8, 0..15
    scale: Tensor  # [N, K / 32] float32
    zero: Tensor  # [N, K / 32] float32

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if k % GROUP_SIZE or self.scale.shape != (n, k // GROUP_SIZE):
            raise ValueError(f"int4 weight {tuple(self.q.shape)} with scales {self.scale.shape}")
        if self.zero.shape != self.scale.shape:
            raise ValueError("int4 zeros and scales differ in shape")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def map_rows(self, fn: Callable[[Tensor], Tensor]) -> Int4Weight:
        """Apply a permutation of the rows (outputs) to the values and their groups' pairs."""
        return Int4Weight(fn(self.q), fn(self.scale), fn(self.zero))

    def dequantize(self) -> Tensor:
        n, k = self.q.shape
        q = self.q.reshape(n, k // GROUP_SIZE, GROUP_SIZE).float() - 8  # [N, G, 32]
        w = q * self.scale[..., None] + self.zero[..., None]  # [N, G, 32]
        return w.reshape(n, k)


@dataclass(slots=True)
class Int8Weight:
    """w[n, k] = scale[n] * q[n, k]; rows are outputs."""

    q: Tensor  # [N, K] int8
    scale: Tensor  # [N] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def map_rows(self, fn: Callable[[Tensor], Tensor]) -> Int8Weight:
        return Int8Weight(fn(self.q), fn(self.scale[:, None])[:, 0])

    def dequantize(self) -> Tensor:
        return self.q.float() * self.scale[:, None]


Weight = Tensor | Int4Weight | Int8Weight


def cat_rows(parts: Sequence[Weight]) -> Weight:
    """Stack weights along the outputs (q, k, v into one qkv), in one format."""
    if all(isinstance(p, Int4Weight) for p in parts):
        int4 = [p for p in parts if isinstance(p, Int4Weight)]
        return Int4Weight(
            torch.cat([p.q for p in int4]),
            torch.cat([p.scale for p in int4]),
            torch.cat([p.zero for p in int4]),
        )
    if all(isinstance(p, Int8Weight) for p in parts):
        int8 = [p for p in parts if isinstance(p, Int8Weight)]
        return Int8Weight(torch.cat([p.q for p in int8]), torch.cat([p.scale for p in int8]))
    return torch.cat([dense(p) for p in parts])


def map_rows(w: Weight, fn: Callable[[Tensor], Tensor]) -> Weight:
    return fn(w) if isinstance(w, Tensor) else w.map_rows(fn)


def dense(w: Weight) -> Tensor:
    return w if isinstance(w, Tensor) else w.dequantize()


# -- quantizing dense weights ------------------------------------------------------------------


def quantize_int4(w: Tensor) -> Int4Weight:
    """Asymmetric min/max per group of 32, as gpt-fast and torch's tests do."""
    n, k = w.shape
    if k % GROUP_SIZE:
        raise ValueError(f"int4 needs in_features divisible by {GROUP_SIZE}, got {k}")
    g = w.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)  # [N, G, 32]
    lo, hi = g.amin(-1), g.amax(-1)  # [N, G]
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15)  # [N, G, 32]
    return Int4Weight(q.to(torch.uint8).reshape(n, k), scale, lo + 8 * scale)


def quantize_int8(w: Tensor) -> Int8Weight:
    """Symmetric per output row: scale = max|w| / 127."""
    w = w.float()
    scale = (w.abs().amax(-1) / 127).clamp(min=1e-8)  # [N]
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


# -- GGUF blocks -------------------------------------------------------------------------------

_Q4_0 = gguf.GGMLQuantizationType.Q4_0
_Q4_1 = gguf.GGMLQuantizationType.Q4_1
_Q4_K = gguf.GGMLQuantizationType.Q4_K


def gguf_int4(data: np.ndarray, kind: gguf.GGMLQuantizationType) -> Int4Weight | None:
    """A Q4_0, Q4_1 or Q4_K tensor's rows ([N, bytes per row] uint8, as gguf's reader holds
    them) as an `Int4Weight` of the same values; None for other types."""
    if kind is _Q4_K:
        return _q4_k_int4(data)
    if kind not in (_Q4_0, _Q4_1):
        return None
    n = data.shape[0]
    block_bytes = 18 if kind is _Q4_0 else 20  # fp16 d, (fp16 m,) 16 bytes of nibbles
    blocks = np.ascontiguousarray(data).reshape(n, -1, block_bytes)  # [N, G, bytes]
    d = _fp16(blocks[..., 0:2])  # [N, G]
    if kind is _Q4_0:
        zero = np.zeros_like(d)
    else:
        m = _fp16(blocks[..., 2:4])
        zero = m + 8 * d  # d * q + m == d * (q - 8) + (m + 8d)
    nibbles = blocks[..., block_bytes - 16 :]  # [N, G, 16]
    # A block's element j is byte j's low nibble, element j + 16 its high nibble.
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, -1)  # [N, K]
    return Int4Weight(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero))


def _q4_k_int4(data: np.ndarray) -> Int4Weight:
    """Q4_K: super-blocks of 256 weights, each an fp16 d and dmin, 8 six-bit (scale, min)
    pairs (12 bytes) and 128 bytes of nibbles. Sub-block j of 32 holds
    w = d * sc_j * q - dmin * m_j = (d * sc_j) * (q - 8) + (8 * d * sc_j - dmin * m_j)
    -> int4, scale d * sc_j, zero 8 * d * sc_j - dmin * m_j: the same values (d * sc_j is
    exact in fp32; the zero rounds once, within fp32's 2^-24)."""
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, 144)  # [N, B, bytes]
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])  # [N, B]
    s = blocks[..., 4:16].astype(np.uint8)  # [N, B, 12]: the packed six-bit pairs
    # ggml's get_scale_min_k4: pairs 0-3 in the low six bits of bytes 0-3 (scales) and 4-7
    # (mins); pairs 4-7 from the nibbles of bytes 8-11 and the top two bits of bytes 0-7.
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    scale = d[..., None] * sc  # [N, B, 8]
    zero = 8 * scale - dmin[..., None] * mn
    qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32)  # [N, B, 4 runs of 64, 1, 32 bytes]
    # Run r's 32 bytes hold sub-block 2r in their low nibbles and 2r + 1 in their high ones.
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1)  # [N, K]
    return Int4Weight(
        torch.from_numpy(q),
        torch.from_numpy(scale.reshape(n, -1).astype(np.float32)),
        torch.from_numpy(zero.reshape(n, -1).astype(np.float32)),
    )


def _fp16(pair: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] fp32: an fp16 stored little-endian."""
    return pair.copy().view(np.float16)[..., 0].astype(np.float32)


# -- modules -----------------------------------------------------------------------------------


class DequantScratch:
    """The one buffer a model's packed projections dequantize into on their dense path, in
    the dtype dense matmuls run fastest in on this CPU (bf16 with AVX512-BF16, else fp32).

    One per model, shared by its layers: the forward runs them one after another on one
    thread, and each consumes its weight (the GEMM reads it) before the next overwrites it.
    Capped, so the dense path never holds more than `max_elements` dequantized weights (the
    LM head's are cut into blocks of rows): the packed formats exist to keep weights small.
    """

    def __init__(self, dtype: torch.dtype = KERNEL_DTYPE, max_elements: int = 1 << 21) -> None:
        if dtype not in native.DENSE_DTYPES:
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
    """A bias-free projection over packed weights, through the native or torch's weight-only
    CPU kernels.

    Holds either int4 (`packed` [N, K/2] uint8, in the VNNI layout where `vnni` is set and
    torch's otherwise, + `scales` [K/32, N, 2], the scale and zero pairs) or int8 (`packed`
    [N, K] int8 + `scales` [N]), all kernel-ready. The VNNI int4 kernel takes its input as
    two int8 digits per group and sums in int32 and fp32; torch's int4 kernel takes its input
    in bf16 and rounds its output to bf16; int8 runs through the native
    fp32 matrix-vector product (`native.int8_gemv`: the LM head's logits stay fp32, where a
    bf16 output put top tokens in exact ties), or torch's bf16 kernel without a compiler.

    NOTE: the kernel follows the batch. The packed kernels read 4-8x fewer bytes than a dense
    matmul, which wins while a step is bound by reading weights (decode), but they unpack the
    weights again for every few rows, so a step of many rows (prefill, large batches) runs
    ~2.5x slower than dense bf16. With a `scratch`, steps of more than `max_packed_tokens`
    rows (`packed_kernel_pays`) dequantize the weight into it (native.py, ~1 ms per decoder
    layer of the default model) and run the dense bf16 GEMM instead. Without one (no C
    compiler) the packed kernel runs at every size. No dense copy is ever kept.
    """

    packed: Tensor
    scales: Tensor

    def __init__(
        self,
        weight: Int4Weight | Int8Weight,
        device: torch.device,
        *,
        scratch: DequantScratch | None = None,
        max_packed_tokens: int = 0,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits = 4 if isinstance(weight, Int4Weight) else 8
        self.max_packed_tokens = max_packed_tokens
        self.scratch = scratch if native.library() is not None else None
        # The VNNI layout where this CPU has AVX512-VNNI and the weight fills its tiles:
        # then every packed step runs the native kernel (the decoder stack's too: faster
        # than torch's bf16 one at a row here, docs/perf.md); else torch's layout and kernel.
        self.vnni = (
            isinstance(weight, Int4Weight)
            and device.type == "cpu"
            and self.out_features % native.VNNI_TILE == 0
            and native.has_vnni()
        )
        if isinstance(weight, Int4Weight):
            if self.vnni:
                packed = native.pack_int4_vnni(weight.q)
            else:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    weight.q.to(torch.int32), _INNER_K_TILES
                )
            pairs = torch.stack([weight.scale, weight.zero], dim=-1)  # [N, G, 2]
            scales = pairs.transpose(0, 1).contiguous()  # [G, N, 2]
        else:
            packed, scales = weight.q.contiguous(), weight.scale
        self.register_buffer("packed", packed.to(device))
        self.register_buffer("scales", scales.to(device=device, dtype=KERNEL_DTYPE))

    @property
    def max_dense_rows(self) -> int:
        """The most output rows one dequantized block holds: whole tiles of 64."""
        assert self.scratch is not None
        rows = self.scratch.max_elements // self.in_features // 64 * 64
        return min(self.out_features, max(rows, 64))

    def forward(self, x: Tensor, threads: int = 1) -> Tensor:
        # x: [T, in] -> [T, out]; `threads` 2 splits the native int8 GEMV with its helper
        if self.scratch is not None and not packed_kernel_pays(x.shape[0], self.max_packed_tokens):
            dense: Tensor = self._dense(x.to(self.scratch.dtype)).to(x.dtype)
            return dense
        if self.vnni:
            # Two int8 digits an input, int32 sums (native.int4_vnni_gemv; bound above).
            return native.int4_vnni_gemv(x.float(), self.packed, self.scales).to(x.dtype)
        if self.bits == 4 and x.shape[0] <= NATIVE_INT4_ROWS and native.library() is not None:
            # fp32 through, and faster than torch's bf16 kernel at one row (native.int4_gemv).
            y32 = native.int4_gemv(x.float(), self.packed, self.scales)
            if y32 is not None:
                return y32.to(x.dtype)
        if self.bits == 8 and native.library() is not None:
            # fp32 through: the LM head's logits keep their precision (native.int8_gemv).
            return native.int8_gemv(x.float(), self.packed, self.scales, threads).to(x.dtype)
        x16 = x.to(KERNEL_DTYPE)
        if self.bits == 4:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x16, self.packed, GROUP_SIZE, self.scales
            )
        else:
            y = torch.ops.aten._weight_int8pack_mm(x16, self.packed, self.scales)
        out: Tensor = y.to(x.dtype)
        return out

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
        if self.bits == 4:
            block = self.scratch.take(self.in_features, end - begin)  # [in, rows]
            dequantize = native.dequantize_int4_vnni if self.vnni else native.dequantize_int4
            return dequantize(self.packed, self.scales, block, (begin, end))
        block = self.scratch.take(end - begin, self.in_features)
        return native.dequantize_int8(self.packed, self.scales, block, (begin, end))

    def extra_repr(self) -> str:
        dense = "" if self.scratch is None else f", dense above {self.max_packed_tokens} rows"
        layout = ", VNNI layout" if self.vnni else ""
        return f"in={self.in_features}, out={self.out_features}, int{self.bits}{layout}{dense}"


class PackedEmbedding(nn.Module):
    """Token embeddings looked up in an int8 weight: the tied LM head's own when the model
    ties them, so the table is held once, a quarter of its fp32 size."""

    packed: Tensor
    scales: Tensor

    def __init__(self, head: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        if head.bits != 8:
            raise ValueError("embeddings are looked up in int8 weights only")
        self.dtype = dtype
        self.register_buffer("packed", head.packed)  # [V, D] int8
        self.register_buffer("scales", head.scales)  # [V] bf16

    def forward(self, ids: Tensor) -> Tensor:
        # ids: [T] int64 -> [T, D] in `dtype`
        rows = self.packed.index_select(0, ids).to(self.dtype)  # [T, D]
        scales: Tensor = self.scales.index_select(0, ids).to(self.dtype)  # [T]
        return rows * scales[:, None]


# The most rows the native int4 GEMV takes: it reads the nibbles once for all rows but
# converts them to fp32 for each, which beat torch's bf16 kernel at one row (119 against 137
# us for a 3072x576 weight here) and lost from four.
NATIVE_INT4_ROWS = 1


# -- which kernel for how many rows ------------------------------------------------------------


def packed_kernel_pays(num_tokens: int, max_packed_tokens: int) -> bool:
    """The packed kernel for a step of `num_tokens` rows, the dense path above the crossover."""
    return num_tokens <= max_packed_tokens


# SmolLM2-135M's per-layer matmuls as (out, in): qkv, o_proj, gate_up, down.
_LAYER_MATMULS = ((960, 576), (576, 576), (3072, 576), (576, 1536))
TRIAL_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def pick_max_packed_tokens(times: Mapping[int, tuple[float, float]]) -> int:
    """From {rows: (packed seconds, dense seconds)}: the most rows up to which the packed
    kernel was faster at every measured size (0: never). Kernel times grow with the rows
    and the packed kernel's faster (it reads less, then computes more per row), so one
    crossover; a size where it lost ends the run even if a larger one looks faster (noise)."""
    best = 0
    for rows in sorted(times):
        packed, dense = times[rows]
        if packed >= dense:
            break
        best = rows
    return best


def measured_max_packed_tokens(bits: int, dense_dtype: torch.dtype = KERNEL_DTYPE) -> int:
    """Time one decoder layer's four matmuls of the default model, the packed kernel (`bits`)
    against the dense path (dequantize to `dense_dtype`, then its GEMM; fp32 input as the
    engine runs), at each of `TRIAL_ROWS`; pick the crossover with `pick_max_packed_tokens`.
    About 0.3 s on a 2-core EPYC. Without the native dequantizer there is no dense path: the
    packed kernel takes every size."""
    if native.library() is None:
        return NO_CROSSOVER
    return _measured_crossover(bits, dense_dtype, torch.get_num_threads())


@functools.cache
def _measured_crossover(bits: int, dense_dtype: torch.dtype, threads: int) -> int:
    # Once per process and thread count: two threads move the crossover.
    return pick_max_packed_tokens(crossover_trial(bits, dense_dtype))


NO_CROSSOVER = 1 << 30  # more rows than any step has


def crossover_trial(bits: int, dense_dtype: torch.dtype) -> dict[int, tuple[float, float]]:
    """{rows: (packed seconds, dense-path seconds)} for one decoder layer's matmuls."""
    weights = _trial_weights()
    quantize = quantize_int4 if bits == 4 else quantize_int8
    cpu = torch.device("cpu")
    scratch = DequantScratch(dense_dtype)
    packed = [QuantLinear(quantize(w), cpu, max_packed_tokens=NO_CROSSOVER) for w in weights]
    dense = [QuantLinear(quantize(w), cpu, scratch=scratch) for w in weights]
    return {rows: _race(rows, packed, dense) for rows in TRIAL_ROWS}


def packed_decode_pays(bits: int, dense_dtype: torch.dtype) -> bool:
    """Whether a decode step of one sequence runs one decoder layer's matmuls 20% faster
    through the packed kernel than over dense `dense_dtype` weights: what `weights auto`
    asks before serving a checkpoint's 4-bit weights packed. The same 20% rule as the
    dtype trial (`config.pick_cpu_dtypes`): a small gain is not worth a new format."""
    return _packed_decode_pays(bits, dense_dtype, torch.get_num_threads())


@functools.cache
def _packed_decode_pays(bits: int, dense_dtype: torch.dtype, threads: int) -> bool:
    weights = _trial_weights()
    quantize = quantize_int4 if bits == 4 else quantize_int8
    cpu = torch.device("cpu")
    packed = [QuantLinear(quantize(w), cpu, max_packed_tokens=NO_CROSSOVER) for w in weights]
    dense = [_DenseMatmul(w.to(dense_dtype)) for w in weights]
    packed_s, dense_s = _race(1, packed, dense)
    return packed_s < 0.8 * dense_s


class _DenseMatmul:
    """A dense projection as the engine's `model.Linear` runs it: input cast to the weight."""

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight
        self.in_features = weight.shape[1]

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)


def _trial_weights() -> list[Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, k, generator=gen) / k**0.5 for n, k in _LAYER_MATMULS]


class _Matmul(Protocol):
    in_features: int

    def __call__(self, x: Tensor) -> Tensor: ...


def _race(rows: int, first: Sequence[_Matmul], second: Sequence[_Matmul]) -> tuple[float, float]:
    """Best-of-three seconds of each layer's matmuls on `rows` fp32 rows, alternating, so a
    neighbour's load falls on both. With one torch thread the clock is the thread's CPU
    time (time spent descheduled does not count), as `config.fastest_cpu_dtypes` does."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    gen = torch.Generator().manual_seed(rows)
    inputs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        for _ in range(3):
            for i, layer in enumerate((first, second)):
                start = clock()
                for m in layer:
                    m(inputs[m.in_features])
                best[i] = min(best[i], clock() - start)
    return best[0], best[1]
