"""Weights of every type but Q5_0 with their rows regrouped eight at a time
(kernels/cpu/src/rows_x8.h, formats.py ROWS_X8), every version this CPU executes: the same
bytes moved, and every kernel that reads a weight gives each output the same bits from them as
from the rows as stored: the int8 products (eight rows in the lanes for up to 16 input rows;
side by side beyond), the fp32 products, the dequantization and the embedding lookup, at any
split of the rows."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import ops
from kernels.cpu.dispatch import KernelSet
from kernels.cpu.formats import Blocks, WeightType, random_blocks, stored_rows_x8
from service.engine.quant import PackedWeight
from tests.cpu_isa import cpu, cpu_isa

__all__ = ["cpu", "cpu_isa"]


@pytest.fixture
def int8(cpu: KernelSet) -> KernelSet:
    return KernelSet(cpu.lib, cpu.chosen, cpu.runnable, matmul_inputs="int8")


def regrouped(kernels: KernelSet, weight: Blocks) -> Blocks:
    copy = Blocks(weight.kind, weight.data.clone(), weight.k)
    return ops.regroup_rows_x8(kernels, copy)


KINDS = [t for t in WeightType if t != WeightType.Q5_0]


@pytest.mark.parametrize("kind", KINDS)
def test_regrouping_moves_the_bytes_and_back(cpu: KernelSet, kind: WeightType) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = random_blocks(kind, 24, 768, gen)
    x8 = regrouped(cpu, weight)
    assert x8.rows_x8 and x8.code == int(kind) | 0x100
    assert not torch.equal(x8.data, weight.data)
    assert torch.equal(x8.data.flatten().sort().values, weight.data.flatten().sort().values)
    assert torch.equal(stored_rows_x8(kind, x8.data), weight.data)  # Python reads it alike
    assert torch.equal(x8.stored(), weight.data)
    status = cpu.lib.pc_rows_x8(int(kind), x8.data.data_ptr(), x8.data.shape[1], 24, 0)
    assert status == 0 and torch.equal(x8.data, weight.data)


def test_every_type_but_q5_0_is_regrouped_in_whole_groups(cpu: KernelSet) -> None:
    gen = torch.Generator().manual_seed(2)
    for kind, rows in ((WeightType.Q4_K, 12), (WeightType.Q4_0, 4), (WeightType.Q5_0, 16)):
        weight = random_blocks(kind, rows, 256, gen)
        with pytest.raises(ValueError):
            ops.regroup_rows_x8(cpu, weight)
        with pytest.raises(ValueError):
            Blocks(kind, weight.data, 256, rows_x8=True)
    q4 = random_blocks(WeightType.Q4_K, 16, 256, gen)
    q5 = random_blocks(WeightType.Q5_0, 16, 256, gen)
    odd = random_blocks(WeightType.Q6_K, 12, 256, gen)
    parts = PackedWeight((q4, q5, odd)).regrouped(cpu).parts
    assert [p.rows_x8 for p in parts] == [True, False, False]
    with pytest.raises(ValueError):
        PackedWeight((parts[0],)).map_rows(lambda w: w.flip(0))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 17, 40])
def test_the_int8_products_are_the_same_bits(int8: KernelSet, kind: WeightType, rows: int) -> None:
    # up to 16 rows: eight weight rows in the lanes, four input rows at a time; more: side by
    # side, each weight row read back as stored first. The rows of 32-weight blocks end in a
    # part chunk (three blocks of eight).
    gen = torch.Generator().manual_seed(rows)
    k = 1024 + (0 if kind in (WeightType.Q4_K, WeightType.Q5_K, WeightType.Q6_K) else 96)
    weight = random_blocks(kind, 32, k, gen)
    x8 = regrouped(int8, weight)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 2, k)
    assert torch.equal(ops.gemv(int8, x8, x), ops.gemv(int8, weight, x))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_any_split_of_the_rows_is_the_same_bits(
    int8: KernelSet, kind: WeightType, rows: int
) -> None:
    # shares that cut through a group take its rows one at a time, as stored
    gen = torch.Generator().manual_seed(10 + rows)
    weight = random_blocks(kind, 48, 512, gen)
    x8 = regrouped(int8, weight)
    v = random_blocks(WeightType.Q5_0, 16, 512, gen)  # a fused projection's other part
    x = torch.randn(rows, 512, generator=gen)
    want = ops.gemv_threads(int8, [weight, v], x, 1)
    for threads in (1, 2, 3, 7):
        assert torch.equal(ops.gemv_threads(int8, [x8, v], x, threads), want), threads
    fn = int8.fn("gemv")
    y = torch.zeros(rows, 48)
    for begin, end in ((0, 3), (3, 11), (11, 16), (16, 48)):
        status = fn(
            x8.code, x8.data.data_ptr(), x8.data.shape[1], x.data_ptr(), rows, 512,
            y.data_ptr(), 48, begin, end,
        )  # fmt: skip
        assert status == 0
    assert torch.equal(y, want[:, :48])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_the_fp32_products_are_the_same_bits(cpu: KernelSet, kind: WeightType, rows: int) -> None:
    gen = torch.Generator().manual_seed(20 + rows)
    weight = random_blocks(kind, 24, 512, gen)
    x8 = regrouped(cpu, weight)
    x = torch.randn(rows, 512, generator=gen)
    assert torch.equal(ops.gemv(cpu, x8, x), ops.gemv(cpu, weight, x))
    for threads in (1, 2):
        got = ops.gemv_threads(cpu, [x8], x, threads)
        assert torch.equal(got, ops.gemv_threads(cpu, [weight], x, threads))


@pytest.mark.parametrize("kind", KINDS)
def test_dequantization_and_lookups_read_the_rows_as_stored(
    cpu: KernelSet, kind: WeightType
) -> None:
    gen = torch.Generator().manual_seed(30)
    weight = random_blocks(kind, 16, 512, gen)
    x8 = regrouped(cpu, weight)
    for dtype in (torch.float32, torch.bfloat16):
        want = ops.dequantize(cpu, weight, (3, 13), torch.empty(10, 512, dtype=dtype))
        got = ops.dequantize(cpu, x8, (3, 13), torch.empty(10, 512, dtype=dtype))
        assert torch.equal(got, want)
    ids = torch.tensor([15, 0, 7, 8, 7], dtype=torch.int64)
    assert torch.equal(ops.dequantize_rows(cpu, x8, ids), ops.dequantize_rows(cpu, weight, ids))
    assert torch.equal(PackedWeight((x8,)).dequantize(), PackedWeight((weight,)).dequantize())


def test_a_regrouped_q5_0_is_no_type_the_kernels_take(int8: KernelSet) -> None:
    # Q5_0 is never regrouped: its code with ROWS_X8 is refused, not read as another type
    gen = torch.Generator().manual_seed(40)
    weight = random_blocks(WeightType.Q5_0, 8, 256, gen)
    x = torch.randn(20, 256, generator=gen)
    code = int(WeightType.Q5_0) | 0x100
    for m in (1, 20):
        y = torch.empty(m, 8)
        status = int8.fn("gemv")(
            code, weight.data.data_ptr(), weight.data.shape[1], x.data_ptr(), m, 256,
            y.data_ptr(), 8, 0, 8,
        )  # fmt: skip
        assert status == 2  # PC_BAD_SHAPE
    out = torch.empty(8, 256)
    status = int8.fn("dequant")(
        code, weight.data.data_ptr(), weight.data.shape[1], 256, 0, 8, out.data_ptr(), 256, 0
    )
    assert status == 2
