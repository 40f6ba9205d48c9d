"""The weight formats the CPU kernels read: GGUF blocks exactly as a GGUF file stores them.

A weight [n, k] of a `WeightType` is n rows of `row_bytes(type, k)` bytes, each row k /
`block_elements` blocks in ggml's layout (fp16 scales and mins as stored). The loader hands
a file's tensors over as they are; a dense weight is quantized into one of these types
(service/engine/quant.py). `Blocks` is one such weight; `random_blocks` makes valid ones
for probes and tests (finite fp16 scales, any bits elsewhere).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor


class WeightType(enum.IntEnum):
    """The GGUF types the kernels serve, numbered as ggml numbers them."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14


# (elements, bytes) per block, and where each block keeps its fp16 scales (byte offsets).
BLOCKS: dict[WeightType, tuple[int, int]] = {
    WeightType.Q4_0: (32, 18),
    WeightType.Q4_1: (32, 20),
    WeightType.Q5_0: (32, 22),
    WeightType.Q8_0: (32, 34),
    WeightType.Q4_K: (256, 144),
    WeightType.Q5_K: (256, 176),
    WeightType.Q6_K: (256, 210),
}
_SCALE_OFFSETS: dict[WeightType, tuple[int, ...]] = {
    WeightType.Q4_0: (0,),
    WeightType.Q4_1: (0, 2),
    WeightType.Q5_0: (0,),
    WeightType.Q8_0: (0,),
    WeightType.Q4_K: (0, 2),
    WeightType.Q5_K: (0, 2),
    WeightType.Q6_K: (208,),
}
# Bits per weight as stored, scales included (for memory figures and logs).
BITS_PER_WEIGHT = {t: bytes_ * 8 / elements for t, (elements, bytes_) in BLOCKS.items()}


def block_elements(kind: WeightType) -> int:
    return BLOCKS[kind][0]


def row_bytes(kind: WeightType, k: int) -> int:
    elements, bytes_ = BLOCKS[kind]
    if k % elements:
        raise ValueError(f"{kind.name} takes rows of whole blocks of {elements}, not {k}")
    return k // elements * bytes_


@dataclass(frozen=True, slots=True)
class Blocks:
    """A weight [n, k] in `kind`'s blocks: `data` [n, row_bytes] uint8, contiguous, on the
    CPU. Rows are outputs: permuting or stacking rows moves whole blocks."""

    kind: WeightType
    data: Tensor
    k: int
    # its rows regrouped eight at a time for the int8 products (ROWS_X8; not Q5_0)
    rows_x8: bool = False

    def __post_init__(self) -> None:
        if self.rows_x8 and (self.kind not in REGROUPED or self.data.shape[0] % 8):
            raise ValueError("rows regrouped eight at a time: 8 n rows of a type but Q5_0 only")
        width = row_bytes(self.kind, self.k)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != width:
            raise ValueError(
                f"{self.kind.name} [n, {self.k}] needs data [n, {width}] uint8, "
                f"got {tuple(self.data.shape)} {self.data.dtype}"
            )
        if not self.data.is_contiguous() or self.data.device.type != "cpu":
            raise ValueError("block data must be a contiguous CPU tensor")

    @property
    def n(self) -> int:
        return int(self.data.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def code(self) -> int:
        """The type as the kernels take it (pagechat_cpu.h): ggml's number, with ROWS_X8."""
        return int(self.kind) | (ROWS_X8 if self.rows_x8 else 0)

    def stored(self) -> Tensor:
        """The rows as the file stores them: `data`, or a copy taken back from ROWS_X8."""
        return stored_rows_x8(self.kind, self.data) if self.rows_x8 else self.data


# NOTE (ROWS_X8): where the products take int8 inputs, the rows of every type but Q5_0 are
# regrouped eight at a time (kernels/cpu/src/rows_x8.h): each block of the eight rows side by
# side, their integers four bytes of each row at a time, so that a product keeps each row's
# sums in its own vector lane and never sums across lanes (the scales of eight rows unpacked
# at once). The same bytes, moved: each row's values are the file's.
ROWS_X8 = 0x100
# Every type but Q5_0 (its fifth bits are one word a block: they would need spreading lane by
# lane, so it is read as stored).
REGROUPED = tuple(t for t in WeightType if t != WeightType.Q5_0)


def _runs(part: Tensor, runs: int) -> Tensor:
    """[groups, blocks, runs * 256] four-bytes-a-row runs -> [groups, blocks, 8, runs * 32]"""
    groups, blocks = part.shape[:2]
    runs_t = part.reshape(groups, blocks, runs, 8, 8, 4).permute(0, 1, 4, 2, 3, 5)
    return runs_t.reshape(groups, blocks, 8, runs * 32)


def stored_rows_x8(kind: WeightType, data: Tensor) -> Tensor:
    """Rows regrouped eight at a time ([n, row_bytes] uint8) back as stored (a copy)."""
    n, width = data.shape
    block = BLOCKS[kind][1]
    groups, blocks = n // 8, width // block
    g = data.reshape(groups, blocks, 8 * block)

    def per_row(part: Tensor, size: int) -> Tensor:  # [8 rows, size] a block
        return part.reshape(groups, blocks, 8, size)

    if kind in (WeightType.Q4_0, WeightType.Q4_1):  # d (and m), 16 bytes of nibbles
        count = 1 if kind == WeightType.Q4_0 else 2
        nibbles = g[..., 16 * count :].reshape(groups, blocks, 4, 8, 4).transpose(2, 3)
        parts = [per_row(g[..., 16 * i : 16 * i + 16], 2) for i in range(count)]
        parts.append(nibbles.reshape(groups, blocks, 8, 16))
    elif kind == WeightType.Q8_0:
        parts = [per_row(g[..., 0:16], 2), _runs(g[..., 16:], 1)]  # d, the weights
    elif kind in (WeightType.Q4_K, WeightType.Q5_K):
        words = g[..., 32:128].reshape(groups, blocks, 3, 8, 4).permute(0, 1, 3, 2, 4)
        parts = [
            per_row(g[..., 0:16], 2),  # d
            per_row(g[..., 16:32], 2),  # dmin
            words.reshape(groups, blocks, 8, 12),
        ]
        if kind == WeightType.Q5_K:  # the fifth bits
            parts.append(_runs(g[..., 128:384], 1))
        parts.append(_runs(g[..., 128 if kind == WeightType.Q4_K else 384 :], 4))
    else:  # Q6_K: ql, qh, the scales per 16, d
        scales = g[..., 16:144].reshape(groups, blocks, 16, 8).transpose(2, 3)
        parts = [
            _runs(g[..., 144:1168], 4),
            _runs(g[..., 1168:], 2),
            scales,
            per_row(g[..., 0:16], 2),
        ]
    rows = torch.cat(parts, -1)  # [groups, blocks, 8 rows, block]
    return rows.permute(0, 2, 1, 3).reshape(n, width).contiguous()


def random_blocks(kind: WeightType, n: int, k: int, generator: torch.Generator) -> Blocks:
    """A valid weight of random values: random bits, with each fp16 scale replaced by one of
    magnitude ~2^-6 (so that a row's products stay near 1) and signs at random."""
    data = torch.randint(0, 256, (n, row_bytes(kind, k)), generator=generator, dtype=torch.uint8)
    elements, bytes_ = BLOCKS[kind]
    blocks = data.view(n, k // elements, bytes_)
    for offset in _SCALE_OFFSETS[kind]:
        scale = torch.rand(n, k // elements, generator=generator) * 0.03 + 0.001
        sign = torch.randint(0, 2, scale.shape, generator=generator) * 2 - 1
        half = (scale * sign).to(torch.float16).view(torch.uint8).view(n, k // elements, 2)
        blocks[..., offset : offset + 2] = half
    return Blocks(kind, data, k)
