"""Weight-only quantized matmul weights: GGUF blocks mapped onto torch's packed CPU kernels.

Two formats, each the layout one of torch's weight-only kernels reads:

- int4 (`Int4Weight`): w[n, k] = scale[n, g] * (q[n, k] - 8) + zero[n, g], q in 0..15, one
  (scale, zero) pair per group of 32 along k (g = k // 32). This is
  `_weight_int4pack_mm_for_cpu`'s dequantization (torch's own test, `_group_quantize_tensor`,
  builds it the same way); the kernel takes q packed by `_convert_weight_to_int4pack_for_cpu`
  and the pairs as `scales_and_zeros` [K/32, N, 2].
- int8 (`Int8Weight`): w[n, k] = scale[n] * q[n, k], q int8, one scale per output row: what
  `_weight_int8pack_mm` reads.

How the GGUF types map (blocks of 32 along a row, each with an fp16 scale d):
- Q4_0: w = d * (q - 8)                        -> int4, scale d, zero 0: exact.
- Q4_1: w = d * q + m = d * (q - 8) + (m + 8d) -> int4, scale d, zero m + 8d: exact (in fp32).
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
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


def gguf_int4(data: np.ndarray, kind: gguf.GGMLQuantizationType) -> Int4Weight | None:
    """A Q4_0 or Q4_1 tensor's rows ([N, bytes per row] uint8, as gguf's reader holds them) as
    an exact `Int4Weight`; None for other types."""
    if kind not in (_Q4_0, _Q4_1):
        return None
    n = data.shape[0]
    block_bytes = 18 if kind is _Q4_0 else 20  # fp16 d, (fp16 m,) 16 bytes of nibbles
    blocks = np.ascontiguousarray(data).reshape(n, -1, block_bytes)  # [N, G, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, G]
    if kind is _Q4_0:
        zero = np.zeros_like(d)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d  # d * q + m == d * (q - 8) + (m + 8d)
    nibbles = blocks[..., block_bytes - 16 :]  # [N, G, 16]
    # A block's element j is byte j's low nibble, element j + 16 its high nibble.
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, -1)  # [N, K]
    return Int4Weight(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero))


# -- modules -----------------------------------------------------------------------------------


class QuantLinear(nn.Module):
    """A bias-free projection over packed weights, through torch's weight-only CPU kernels.

    Holds either int4 (`packed` [N, K/2] uint8 + `scales` [K/32, N, 2], the scale and zero
    pairs) or int8 (`packed` [N, K] int8 + `scales` [N]), all kernel-ready; the input is cast
    to bf16 for the kernel and the output back to the input's dtype.

    NOTE: the kernel follows the batch. With a `dense` copy (the same weights dequantized),
    steps of more than `max_packed_tokens` rows take the dense matmul instead
    (`packed_kernel_pays`): the packed kernels read 4-8x fewer bytes, which wins while a
    step is bound by reading weights, and lose to a dense GEMM once a step's rows are many.
    """

    packed: Tensor
    scales: Tensor
    dense: Tensor | None

    def __init__(
        self,
        weight: Int4Weight | Int8Weight,
        device: torch.device,
        *,
        dense: Tensor | None = None,
        max_packed_tokens: int = 0,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits = 4 if isinstance(weight, Int4Weight) else 8
        self.max_packed_tokens = max_packed_tokens
        if isinstance(weight, Int4Weight):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                weight.q.to(torch.int32), _INNER_K_TILES
            )
            pairs = torch.stack([weight.scale, weight.zero], dim=-1)  # [N, G, 2]
            scales = pairs.transpose(0, 1).contiguous()  # [G, N, 2]
        else:
            packed, scales = weight.q.contiguous(), weight.scale
        self.register_buffer("packed", packed.to(device))
        self.register_buffer("scales", scales.to(device=device, dtype=KERNEL_DTYPE))
        if dense is not None and dense.shape != weight.shape:
            raise ValueError(f"dense copy {tuple(dense.shape)} of a {tuple(weight.shape)} weight")
        self.register_buffer("dense", dense)

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, in] -> [T, out]
        if self.dense is not None and not packed_kernel_pays(x.shape[0], self.max_packed_tokens):
            return F.linear(x.to(self.dense.dtype), self.dense).to(x.dtype)
        x16 = x.to(KERNEL_DTYPE)
        if self.bits == 4:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x16, self.packed, GROUP_SIZE, self.scales
            )
        else:
            y = torch.ops.aten._weight_int8pack_mm(x16, self.packed, self.scales)
        out: Tensor = y.to(x.dtype)
        return out

    def extra_repr(self) -> str:
        dense = "" if self.dense is None else f", dense above {self.max_packed_tokens} rows"
        return f"in={self.in_features}, out={self.out_features}, int{self.bits}{dense}"


# -- which kernel for how many rows ------------------------------------------------------------


def packed_kernel_pays(num_tokens: int, max_packed_tokens: int) -> bool:
    """The packed kernel for a step of `num_tokens` rows, the dense copy above the crossover."""
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


@functools.cache
def measured_max_packed_tokens(bits: int, dense_dtype: torch.dtype) -> int:
    """Time one decoder layer's four matmuls of the default model, packed (`bits`) against
    dense (`dense_dtype`, fp32 input as the engine runs), at each of `TRIAL_ROWS`; pick the
    crossover with `pick_max_packed_tokens`. Trials alternate, the best of three counts, and
    with one torch thread they count the thread's CPU time (a neighbour's load does not tip
    it), as `config.fastest_cpu_dtypes` does. About 0.5 s on a 2-core EPYC."""
    return pick_max_packed_tokens(crossover_trial(bits, dense_dtype))


def crossover_trial(bits: int, dense_dtype: torch.dtype) -> dict[int, tuple[float, float]]:
    """{rows: (packed seconds, dense seconds)} for one decoder layer's matmuls."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) / k**0.5 for n, k in _LAYER_MATMULS]
    quantize = quantize_int4 if bits == 4 else quantize_int8
    cpu = torch.device("cpu")
    layers = {
        "packed": [QuantLinear(quantize(w), cpu) for w in weights],
        "dense": [
            QuantLinear(quantize(w), cpu, dense=w.to(dense_dtype), max_packed_tokens=0)
            for w in weights
        ],
    }
    times: dict[int, tuple[float, float]] = {}
    with torch.inference_mode():
        for rows in TRIAL_ROWS:
            inputs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
            best = dict.fromkeys(layers, float("inf"))
            for _ in range(3):
                for name, mods in layers.items():
                    start = clock()
                    for m in mods:
                        m(inputs[m.in_features])
                    best[name] = min(best[name], clock() - start)
            times[rows] = (best["packed"], best["dense"])
    return times
