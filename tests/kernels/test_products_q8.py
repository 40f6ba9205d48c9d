"""The int8 products (kernels/cpu/src/products_q8.c, tiles_q8.c), every version this CPU
executes: the inputs quantized per 32 as ggml's Q8_0 quantizes them, then exactly the dot
product of those values with the weights as gguf dequantizes them (up to fp32 rounding), and a
row's output the same bits whatever else the call holds: one to four rows straight from the
blocks, more side by side in the lanes, any split of the weight rows, one thread or two."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels.cpu import dispatch, ops
from kernels.cpu.dispatch import KernelSet
from kernels.cpu.formats import Blocks, WeightType, random_blocks
from tests.cpu_isa import cpu, cpu_isa

__all__ = ["cpu", "cpu_isa"]

K_TYPES = (WeightType.Q4_K, WeightType.Q5_K, WeightType.Q6_K)


@pytest.fixture
def int8(cpu: KernelSet) -> KernelSet:
    """The version under test with int8 inputs in its products."""
    return KernelSet(cpu.lib, cpu.chosen, cpu.runnable, matmul_inputs="int8")


def _gguf(weight: Blocks) -> torch.Tensor:
    kind = gguf.GGMLQuantizationType(int(weight.kind))
    return torch.from_numpy(np.array(gguf.quants.dequantize(weight.data.numpy(), kind)))


def _k(kind: WeightType, blocks: int) -> int:
    """k of `blocks` blocks; the types of 32 one more, so their rows end in a part chunk."""
    return blocks * 256 if kind in K_TYPES else blocks * 256 + 96


def q8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's Q8_0 of x [m, k], in torch's fp32: q [m, k] and the scale per 32 [m, k / 32]."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    amax = blocks.abs().amax(-1)
    d = amax / 127
    inv = torch.where(amax > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None])  # to nearest, ties to even, as the kernels
    return q.view(m, k), d


def _dequantized_inputs(x: torch.Tensor) -> torch.Tensor:
    q, d = q8_reference(x)
    m, k = x.shape
    return (q.double().view(m, k // 32, 32) * d.double()[..., None]).view(m, k)


def _fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    k = x.shape[1]
    return k * 2.0**-24 * (x.double().abs() @ w.double().abs().t()) + 1e-30


def test_inputs_are_quantized_per_32_as_ggml_quantizes_them(cpu: KernelSet) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 160, generator=gen) * torch.logspace(-4, 4, 160)
    x[2, 32:64] = 0.0  # an all-zero block: scale 0, values 0
    q, scales, sums32, sums16 = ops.quantize_q8(cpu, x)
    want_q, want_d = q8_reference(x)
    assert torch.equal(q.float(), want_q)
    assert torch.equal(scales, want_d)
    assert q.abs().max() <= 127
    groups = want_q.view(5, 5, 2, 16).sum(-1)
    assert torch.equal(sums16, (want_d[..., None] * groups).view(5, 10))
    assert torch.equal(sums32, want_d * groups.sum(-1))


def test_a_block_with_an_infinity_or_nan_makes_its_outputs_nan(int8: KernelSet) -> None:
    gen = torch.Generator().manual_seed(2)
    weight = random_blocks(WeightType.Q4_K, 6, 256, gen)
    x = torch.randn(3, 256, generator=gen)
    x[1, 40] = float("inf")
    x[2, 200] = float("nan")
    y = ops.gemv(int8, weight, x)
    assert torch.isfinite(y[0]).all()
    assert torch.isnan(y[1:]).all()


@pytest.mark.parametrize("kind", list(WeightType))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17, 40])
def test_the_product_is_the_int8_inputs_dot_the_dequantized_weights(
    int8: KernelSet, kind: WeightType, rows: int
) -> None:
    gen = torch.Generator().manual_seed(rows + 100 * int(kind))
    weight = random_blocks(kind, 11, _k(kind, 2), gen)
    w = _gguf(weight).double()
    x = torch.randn(rows, weight.k, generator=gen)
    xq = _dequantized_inputs(x)
    got = ops.gemv(int8, weight, x).double()
    assert ((got - xq @ w.t()).abs() <= _fp32_bound(xq.float(), w)).all()


@pytest.mark.parametrize("kind", list(WeightType))
def test_the_int8_inputs_cost_at_most_half_a_step_of_each_block(
    int8: KernelSet, kind: WeightType
) -> None:
    # Each input moves by at most half its block's step (d / 2): the product by at most
    # sum |w| d / 2 against the fp32 inputs' (and their own fp32 rounding).
    gen = torch.Generator().manual_seed(int(kind))
    weight = random_blocks(kind, 9, _k(kind, 2), gen)
    w = _gguf(weight).double()
    x = torch.randn(7, weight.k, generator=gen) * 3
    _, d = q8_reference(x)
    step = d.double().repeat_interleave(32, dim=1) / 2  # [m, k]
    bound = step @ w.abs().t() + 2 * _fp32_bound(x, w)
    got = ops.gemv(int8, weight, x).double()
    assert ((got - x.double() @ w.t()).abs() <= bound).all()


@pytest.mark.parametrize("kind", list(WeightType))
def test_a_rows_output_is_the_same_bits_at_any_row_count_split_or_thread_count(
    int8: KernelSet, kind: WeightType
) -> None:
    # Rows 1-4 are taken a row at a time from the blocks; more side by side in vector lanes
    # (16, 8 or 4 a vector: 70 rows end in a part vector of every width), the weight rows
    # four, two or one at a time (19 rows: a rest of every size). Every path takes each
    # output's terms in one order, so a sequence's logits do not depend on its neighbours.
    gen = torch.Generator().manual_seed(3 + int(kind))
    weight = random_blocks(kind, 19, _k(kind, 2), gen)
    x = torch.randn(70, weight.k, generator=gen)
    alone = torch.cat([ops.gemv(int8, weight, x[i : i + 1]) for i in range(70)])
    for rows in (2, 3, 4, 5, 8, 16, 17, 33, 70):
        assert torch.equal(ops.gemv(int8, weight, x[:rows]), alone[:rows]), rows
    for rows in (3, 40):
        for threads in (1, 2):
            got = ops.gemv_threads(int8, [weight], x[:rows], threads)
            assert torch.equal(got, alone[:rows])


def test_parts_of_other_types_follow_one_another(int8: KernelSet) -> None:
    gen = torch.Generator().manual_seed(4)
    q = random_blocks(WeightType.Q4_K, 48, 512, gen)
    v = random_blocks(WeightType.Q6_K, 16, 512, gen)  # a V stored in another type
    for rows in (1, 6):
        x = torch.randn(rows, 512, generator=gen)
        want = torch.cat([ops.gemv(int8, q, x), ops.gemv(int8, v, x)], dim=1)
        for threads in (1, 2):
            assert torch.equal(ops.gemv_threads(int8, [q, v], x, threads), want)


@pytest.mark.parametrize("kind", [WeightType.Q4_1, WeightType.Q6_K])
def test_inputs_past_a_megabyte_pass_in_blocks_that_change_no_bit(
    int8: KernelSet, kind: WeightType
) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = random_blocks(kind, 10, 4096, gen)
    x = torch.randn(200, 4096, generator=gen)  # 1.2 MB of int8 rows: two passes
    whole = ops.gemv(int8, weight, x)
    assert torch.equal(whole[150:], ops.gemv(int8, weight, x[150:]))


def test_every_version_agrees_with_the_generic_one(int8: KernelSet) -> None:
    generic = dispatch.uniform(int8.lib, "generic")
    generic = KernelSet(generic.lib, generic.chosen, matmul_inputs="int8")
    gen = torch.Generator().manual_seed(6)
    for kind in WeightType:
        weight = random_blocks(kind, 13, _k(kind, 1), gen)
        w = _gguf(weight)
        for rows in (1, 4, 21):
            x = torch.randn(rows, weight.k, generator=gen)
            got, want = ops.gemv(int8, weight, x), ops.gemv(generic, weight, x)
            assert ((got.double() - want.double()).abs() <= 2 * _fp32_bound(x, w)).all()
