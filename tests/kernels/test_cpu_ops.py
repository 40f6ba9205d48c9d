"""The CPU kernels (kernels/cpu/ops.py), every version this CPU executes: GGUF blocks
dequantized exactly as gguf does, fp32 products within fp32 rounding of float64 over those
values, paged decode attention against SDPA over a gathered cache in every cache dtype,
RoPE with the cache write, RMSNorm, SiLU and tanh-GELU against torch, sampling against
float64."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import dispatch, ops
from kernels.cpu.dispatch import KernelSet
from kernels.cpu.formats import Blocks, WeightType, random_blocks, row_bytes
from kernels.cpu.library import library
from service.engine.model import apply_rope
from tests.cpu_isa import cpu, cpu_isa
from tests.kernels.sampling_cases import SampleCase, check_picks, sample_case

__all__ = ["cpu", "cpu_isa"]

K_TYPES = (WeightType.Q4_K, WeightType.Q5_K, WeightType.Q6_K)


def _gguf(weight: Blocks) -> torch.Tensor:
    """What gguf's own dequantization makes of the blocks: the reference values."""
    kind = gguf.GGMLQuantizationType(int(weight.kind))
    return torch.from_numpy(np.array(gguf.quants.dequantize(weight.data.numpy(), kind)))


def _k(kind: WeightType, blocks: int) -> int:
    return blocks * (256 if kind in K_TYPES else 32)


def _fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|y - x w^T| of an fp32 dot product of length k against float64: k eps per |x||w|."""
    k = x.shape[1]
    return k * 2.0**-24 * (x.double().abs() @ w.double().abs().t()) + 1e-30


def test_the_block_sizes_are_ggufs() -> None:
    for kind in WeightType:
        elements, bytes_ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(kind))]
        assert row_bytes(kind, 3 * elements) == 3 * bytes_


@pytest.mark.parametrize("kind", list(WeightType))
def test_every_type_dequantizes_to_ggufs_values_exactly(cpu: KernelSet, kind: WeightType) -> None:
    gen = torch.Generator().manual_seed(int(kind))
    weight = random_blocks(kind, 12, _k(kind, 3), gen)
    want = _gguf(weight)
    got = ops.dequantize(cpu, weight, (0, 12), torch.empty(12, weight.k))
    assert torch.equal(got, want)
    rows = ops.dequantize(cpu, weight, (5, 9), torch.empty(4, weight.k, dtype=torch.bfloat16))
    assert torch.equal(rows, want[5:9].to(torch.bfloat16))  # rounded as torch rounds
    ids = torch.tensor([11, 0, 11, 3])
    assert torch.equal(ops.dequantize_rows(cpu, weight, ids), want[ids])


@pytest.mark.parametrize("kind", list(WeightType))
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 9])
def test_the_product_is_an_fp32_dot_product_of_the_dequantized_weights(
    cpu: KernelSet, kind: WeightType, rows: int
) -> None:
    gen = torch.Generator().manual_seed(rows + 100 * int(kind))
    weight = random_blocks(kind, 24, _k(kind, 2), gen)
    w = _gguf(weight)
    x = torch.randn(rows, weight.k, generator=gen)
    got = ops.gemv(cpu, weight, x)
    want = x.double() @ w.double().t()
    assert ((got.double() - want).abs() <= _fp32_bound(x, w)).all()


AMX_BOUND = 2.0**-15  # three bf16 products: ~2^-16 of |x| |w| (quants.c), twice for margin


@pytest.mark.parametrize("kind", list(WeightType))
@pytest.mark.parametrize(("rows", "weights"), [(32, 40), (33, 16), (70, 37), (128, 8)])
def test_products_of_many_rows_keep_within_their_versions_bound(
    cpu: KernelSet, cpu_isa: str, kind: WeightType, rows: int, weights: int
) -> None:
    # From 32 rows the amx version goes through the tile unit: input rows past a 16-row tile
    # and weight rows past a 16-row one are padding that must not show, and its bound is the
    # split's (AMX_BOUND); every other version's tiles are fp32 dot products.
    gen = torch.Generator().manual_seed(rows + weights + 100 * int(kind))
    weight = random_blocks(kind, weights, _k(kind, 2), gen)
    w = _gguf(weight)
    x = torch.randn(rows, weight.k, generator=gen)
    want = x.double() @ w.double().t()
    for threads in (1, 2, 3):
        got = ops.gemv_threads(cpu, [weight], x, threads).double()
        if cpu_isa == "amx":
            bound = AMX_BOUND * (x.double().abs() @ w.double().abs().t()) + 1e-30
        else:
            bound = _fp32_bound(x, w)
        assert ((got - want).abs() <= bound).all()


@pytest.mark.parametrize("kind", [WeightType.Q4_1, WeightType.Q6_K])
def test_inputs_past_a_megabyte_pass_in_blocks_that_change_no_bit(
    cpu: KernelSet, cpu_isa: str, kind: WeightType
) -> None:
    # 70 rows of 4,096 (1.1 MB): two passes of 35 rows over the weights (quants.c INPUT_BYTES),
    # each what a call with those 35 rows alone computes.
    gen = torch.Generator().manual_seed(9)
    weight = random_blocks(kind, 20, 4096, gen)
    x = torch.randn(70, 4096, generator=gen)
    whole = ops.gemv(cpu, weight, x)
    assert torch.equal(
        whole, torch.cat([ops.gemv(cpu, weight, x[:35]), ops.gemv(cpu, weight, x[35:])])
    )
    w = _gguf(weight).double()
    per_term = AMX_BOUND if cpu_isa == "amx" else 4096 * 2.0**-24
    bound = per_term * (x.double().abs() @ w.abs().t()) + 1e-30
    assert ((whole.double() - x.double() @ w.t()).abs() <= bound).all()


@pytest.mark.parametrize("kind", [WeightType.Q4_1, WeightType.Q6_K])
def test_a_rows_product_is_the_same_at_up_to_four_rows(cpu: KernelSet, kind: WeightType) -> None:
    # One to four rows take the same sums whatever the split of the weight rows: a decoding
    # sequence's logits are the same bits beside up to three others. More rows go through
    # tiles of dequantized rows, another order of additions.
    gen = torch.Generator().manual_seed(7)
    weight = random_blocks(kind, 17, _k(kind, 2), gen)  # 17: four-row groups and a rest
    x = torch.randn(9, weight.k, generator=gen)
    alone = torch.cat([ops.gemv(cpu, weight, x[i : i + 1]) for i in range(9)])
    for rows in (2, 3, 4):
        assert torch.equal(ops.gemv(cpu, weight, x[:rows]), alone[:rows])
    w = ops.dequantize(cpu, weight, (0, 17), torch.empty(17, weight.k))
    for rows in (5, 9):
        got = ops.gemv(cpu, weight, x[:rows]).double()
        assert ((got - alone[:rows].double()).abs() <= 2 * _fp32_bound(x[:rows], w)).all()


def test_two_threads_compute_the_same_product_and_parts_follow_one_another(
    cpu: KernelSet,
) -> None:
    gen = torch.Generator().manual_seed(8)
    q = random_blocks(WeightType.Q4_K, 64, 512, gen)
    v = random_blocks(WeightType.Q6_K, 32, 512, gen)  # a V stored in another type
    x = torch.randn(3, 512, generator=gen)
    want = torch.cat([ops.gemv(cpu, q, x), ops.gemv(cpu, v, x)], dim=1)
    for threads in (1, 2, 3, 7):  # 7: six shares of 16 rows, two of them in V's 32
        assert torch.equal(ops.gemv_threads(cpu, [q, v], x, threads), want)


def test_no_input_rows_give_an_empty_product(cpu: KernelSet) -> None:
    # A step whose chunks all continue a prefill samples nothing: its LM head gets no rows.
    weight = random_blocks(WeightType.Q8_0, 64, 64, torch.Generator().manual_seed(13))
    assert ops.gemv(cpu, weight, torch.empty(0, 64)).shape == (0, 64)
    assert ops.gemv_threads(cpu, [weight], torch.empty(0, 64), 2).shape == (0, 64)


def test_shapes_that_do_not_fit_are_refused_before_any_memory_is_touched(
    cpu: KernelSet,
) -> None:
    gen = torch.Generator().manual_seed(9)
    weight = random_blocks(WeightType.Q8_0, 8, 64, gen)
    with pytest.raises(ValueError, match="input"):
        ops.gemv(cpu, weight, torch.randn(2, 32))
    with pytest.raises(ValueError, match="rows"):
        ops.dequantize(cpu, weight, (4, 9), torch.empty(5, 64))
    with pytest.raises(ValueError, match="out"):
        ops.dequantize(cpu, weight, (0, 8), torch.empty(8, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="row ids"):
        ops.dequantize_rows(cpu, weight, torch.tensor([8]))
    with pytest.raises(ValueError, match="whole blocks"):
        Blocks(WeightType.Q4_K, torch.zeros(2, 144, dtype=torch.uint8), 100)


def _cache(
    dtype: torch.dtype, gen: torch.Generator, hkv: int = 2, d: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    # [N, bs, Hkv, D] with NaN in every slot no sequence owns: a wrong index shows
    k, v = torch.randn(2, 12, 4, hkv, d, generator=gen).unbind(0)
    owned = torch.zeros(12 * 4, dtype=torch.bool)
    owned[:40] = True
    for cache in (k, v):
        cache.view(48, hkv, d)[~owned] = float("nan")
    return k.to(dtype).contiguous(), v.to(dtype).contiguous()


# (query heads, KV heads, head size): the kernel scores a KV head's query heads four at a
# time and accumulates 2 (AVX2) or 4 (AVX512) vectors of each output at a time, so groups of
# 1, 3, 6 and 8 heads and head sizes of 5 and 8 vectors cover its whole and partial steps.
HEAD_LAYOUTS = [(6, 2, 64), (8, 1, 64), (12, 2, 80), (7, 7, 128), (4, 4, 16)]


@pytest.mark.parametrize("dtype", list(ops.ELEMENT_TYPES))
@pytest.mark.parametrize(("hq", "hkv", "d"), HEAD_LAYOUTS)
def test_paged_decode_reads_the_cache_in_place_as_sdpa_over_it_does(
    cpu: KernelSet, dtype: torch.dtype, hq: int, hkv: int, d: int
) -> None:
    gen = torch.Generator().manual_seed(10)
    k, v = _cache(dtype, gen, hkv, d)
    query = torch.randn(3, hq, d, generator=gen)
    lens = torch.tensor([40, 1, 17])
    slots = torch.stack([torch.randperm(40, generator=gen) for _ in range(3)])  # [3, 40]
    got = ops.paged_decode(cpu, query, k, v, slots, lens, d**-0.5)
    for b in range(3):
        ctx = slots[b, : lens[b]]
        keys = k.view(48, hkv, d)[ctx].float().transpose(0, 1)[None]  # [1, Hkv, C, D]
        values = v.view(48, hkv, d)[ctx].float().transpose(0, 1)[None]
        want = F.scaled_dot_product_attention(
            query[b][None, :, None], keys, values, scale=d**-0.5, enable_gqa=True
        )[0, :, 0]
        assert torch.allclose(got[b], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", list(ops.ELEMENT_TYPES))
def test_rope_rotates_q_and_k_and_writes_k_and_v_to_their_slots(
    cpu: KernelSet, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d = 4, 2, 64
    qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=gen)
    angles = torch.rand(3, d // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)  # signed for rotate_half
    slots = torch.tensor([7, 0, 22])
    k, v = (torch.zeros(6, 4, hkv, d, dtype=dtype) for _ in range(2))
    rotated = qkv.clone()
    ops.rope_write(cpu, rotated, hq, cos, sin, slots, k, v)
    heads = qkv.view(3, hq + 2 * hkv, d)
    want = apply_rope(heads[:, : hq + hkv], cos[:, None], sin[:, None])
    assert torch.allclose(rotated.view(3, -1, d)[:, : hq + hkv], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(rotated.view(3, -1, d)[:, hq + hkv :], heads[:, hq + hkv :])
    flat_k, flat_v = k.view(24, hkv, d), v.view(24, hkv, d)
    assert torch.allclose(flat_k[slots].float(), want[:, hq:].to(dtype).float(), rtol=1e-2)
    assert torch.equal(flat_v[slots], heads[:, hq + hkv :].to(dtype))  # rounded as torch
    others = torch.ones(24, dtype=torch.bool)
    others[slots] = False
    assert not flat_k[others].any() and not flat_v[others].any()


def test_rms_norm_silu_and_gelu_match_torch_in_fp32(cpu: KernelSet) -> None:
    gen = torch.Generator().manual_seed(12)
    x, w = torch.randn(5, 101, generator=gen) * 3, torch.randn(101, generator=gen)
    want = F.rms_norm(x, (101,), w, 1e-5)
    assert torch.allclose(ops.rms_norm(cpu, x, w, 1e-5), want, rtol=1e-5, atol=1e-6)
    gate_up = torch.randn(4, 2 * 96, generator=gen) * 8
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert torch.allclose(ops.silu_mul(cpu, gate_up), want, rtol=1e-5, atol=1e-6)
    want = _gelu_tanh(gate) * up
    assert torch.allclose(ops.gelu_tanh_mul(cpu, gate_up).double(), want, rtol=1e-5, atol=1e-6)


def _gelu_tanh(gate: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation in float64, as g sigmoid(2 y) (= g (1 + tanh(y)) / 2): torch's
    own fp32 1 + tanh(y) cancels to 0 below g = -5 or so, where the kernel keeps the value."""
    g = gate.double()
    return g * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))


def test_gelu_keeps_its_precision_far_below_zero_and_its_value_far_above(cpu: KernelSet) -> None:
    gate = torch.tensor([-9.0, -6.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 6.0, 40.0, 1e20])
    gate_up = torch.cat([gate, torch.ones_like(gate)])[None]
    want = _gelu_tanh(gate)
    want[-1] = 1e20  # g^3 overflows: the sigmoid's 1
    got = ops.gelu_tanh_mul(cpu, gate_up)[0]
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("seed", range(6))
def test_sampling_picks_what_a_float64_reference_picks(cpu: KernelSet, seed: int) -> None:
    case = sample_case(seed)
    check_picks(case, _sample(cpu, case))


def test_every_sampling_version_picks_the_generic_versions_ids(cpu: KernelSet) -> None:
    """Bit for bit the same weights and sums in every version, so the same ids; the whole
    vocabulary of a real model, dense and sparse masks."""
    lib = library()
    assert lib is not None
    generic = dispatch.uniform(lib, "generic")
    gen = torch.Generator().manual_seed(8)
    vocab = 49152
    x = torch.randn(16, vocab, generator=gen) * 3
    bits = torch.randint(-(2**31), 2**31, (16, vocab // 32), generator=gen).to(torch.int32)
    bits[8:, 50:] = 0
    temps = torch.tensor([0.0, 0.5, 1.0, 1.5] * 4)
    min_p = torch.tensor([0.0] * 12 + [0.05] * 4)
    for _ in range(5):
        uniforms = torch.rand(16, generator=gen, dtype=torch.float64)
        want = ops.sample(generic, x, bits, temps, min_p, uniforms)
        assert torch.equal(ops.sample(cpu, x, bits, temps, min_p, uniforms), want)


def test_sampling_refuses_what_it_cannot_read(cpu: KernelSet) -> None:
    x, bits = torch.zeros(2, 40), torch.full((2, 2), -1, dtype=torch.int32)
    one, zero, u = torch.ones(2), torch.zeros(2), torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="logits"):
        ops.sample(cpu, x.double(), bits, one, zero, u)
    with pytest.raises(ValueError, match="uniforms"):
        ops.sample(cpu, x, bits, one, zero, u.float())
    with pytest.raises(ValueError, match="allowed"):
        ops.sample(cpu, x, bits[:1], one, zero, u)
    assert ops.sample(cpu, x[:0], bits[:0], one[:0], zero[:0], u[:0]).numel() == 0


def _sample(kernels: KernelSet, case: SampleCase) -> torch.Tensor:
    return ops.sample(
        kernels, case.logits, case.allowed, case.temperatures, case.min_p, case.uniforms
    )


def test_sampling_reads_one_row_views_and_expanded_rows(cpu: KernelSet) -> None:
    """A row picked from a wider batch keeps the batch's stride; an expanded row has stride 0:
    both are read as the rows they show."""
    x = torch.randn(4, 40)
    bits = torch.full((3, 2), -1, dtype=torch.int32)
    greedy, zero, u = torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.float64)
    one_row = x[2:3, :].as_strided((1, 40), (7, 1), storage_offset=80)  # stride(0) odd
    assert ops.sample(cpu, one_row, bits[:1], greedy[:1], zero[:1], u[:1]).item() == int(
        x[2].argmax()
    )
    expanded = x[1:2].expand(3, 40)
    assert ops.sample(cpu, expanded, bits, greedy, zero, u).tolist() == [int(x[1].argmax())] * 3
