"""Packed weights (service/engine/quant.py): GGUF blocks kept, stacked and permuted whole,
dense weights quantized as gguf quantizes them, and the two paths a projection runs (the
native GEMV, the dense path above its crossover) within fp32 rounding of each other."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels.cpu import dispatch, ops
from kernels.cpu.dispatch import KernelSet
from kernels.cpu.formats import Blocks, WeightType, random_blocks
from service.engine.families.llama import unpermute_rope
from service.engine.loader import default_model_path, open_gguf
from service.engine.quant import (
    NO_CROSSOVER,
    TRIAL_ROWS,
    DequantScratch,
    PackedEmbedding,
    PackedWeight,
    QuantLinear,
    cat_rows,
    measured_max_packed_tokens,
    packed_kernel_pays,
    pick_max_packed_tokens,
    quantize,
    weights_name,
)


@pytest.fixture(scope="module")
def kernels() -> KernelSet:
    chosen = dispatch.select("auto")
    assert chosen is not None, "the CPU kernels did not build"
    return chosen


def _random(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def _packed(kind: WeightType, n: int, k: int, seed: int) -> PackedWeight:
    return PackedWeight((random_blocks(kind, n, k, torch.Generator().manual_seed(seed)),))


def _fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().t()) + 1e-30


@pytest.mark.parametrize(
    "kind", [WeightType.Q4_0, WeightType.Q4_1, WeightType.Q5_0, WeightType.Q8_0]
)
def test_dense_weights_quantize_as_ggufs_quantizer_does(kind: WeightType) -> None:
    w = _random(48, 96, seed=int(kind))
    packed = quantize(w, kind)
    want = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(int(kind)))
    assert np.array_equal(packed.parts[0].data.numpy(), want)
    step = (w.abs().max() / 7).item()  # a 4-bit step at most: values land near their own
    assert float((packed.dequantize() - w).abs().max()) <= step
    with pytest.raises(ValueError, match="quantize to"):
        quantize(w[:, :64].repeat(1, 4), WeightType.Q4_K)


def test_stacked_weights_keep_their_blocks_where_they_are() -> None:
    # Up to three parts (qkv, gate_up), one a tensor, their data not copied (a GGUF's stays
    # in its map); past three, each run of a type joined into one.
    q, k = _packed(WeightType.Q4_K, 64, 256, 1), _packed(WeightType.Q4_K, 32, 256, 2)
    v = _packed(WeightType.Q6_K, 32, 256, 3)
    qkv = cat_rows([q, k, v])
    assert isinstance(qkv, PackedWeight)
    assert [(p.kind, p.n) for p in qkv.parts] == [
        (WeightType.Q4_K, 64), (WeightType.Q4_K, 32), (WeightType.Q6_K, 32),
    ]  # fmt: skip
    assert [p.data.data_ptr() for p in qkv.parts] == [w.parts[0].data.data_ptr() for w in (q, k, v)]
    assert qkv.shape == (128, 256) and qkv.kinds == (WeightType.Q4_K, WeightType.Q6_K)
    dense = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    assert torch.equal(qkv.dequantize(), dense)
    assert qkv.nbytes == q.nbytes + k.nbytes + v.nbytes  # the file's bytes, no more
    four = cat_rows([q, k, v, _packed(WeightType.Q6_K, 16, 256, 4)])
    assert isinstance(four, PackedWeight)
    assert [(p.kind, p.n) for p in four.parts] == [(WeightType.Q4_K, 96), (WeightType.Q6_K, 48)]
    with pytest.raises(ValueError, match="quantize the dense ones"):
        cat_rows([q, torch.zeros(4, 256)])


def test_rows_permute_with_their_blocks() -> None:
    # llama.cpp's converter permutes Q and K rows; undoing it moves whole rows of blocks.
    # In place: the weight is consumed (a GGUF's rows move within its copy-on-write map).
    q = _packed(WeightType.Q5_0, 64, 64, 4)
    want = unpermute_rope(q.dequantize(), 4)
    storage = q.parts[0].data.data_ptr()
    undone = q.map_rows(lambda w: unpermute_rope(w, 4))
    assert torch.equal(undone.dequantize(), want)
    assert undone.parts[0].data.data_ptr() == storage


def test_steps_above_the_crossover_dequantize_and_run_a_dense_fp32_matmul(
    kernels: KernelSet,
) -> None:
    weight = cat_rows([_packed(WeightType.Q4_1, 64, 128, 5), _packed(WeightType.Q8_0, 32, 128, 6)])
    assert isinstance(weight, PackedWeight)
    w = weight.dequantize()
    layer = QuantLinear(weight, kernels, scratch=DequantScratch(torch.float32), max_packed_tokens=4)
    gemv_only = QuantLinear(weight, kernels)
    small, large = _random(4, 128, seed=10), _random(5, 128, seed=11)
    assert torch.equal(layer(small), gemv_only(small))  # the native GEMV
    for x in (small, large):
        got = layer(x).double()
        assert ((got - x.double() @ w.double().t()).abs() <= _fp32_bound(x, w)).all()
    assert torch.allclose(layer(large), gemv_only(large), rtol=1e-5, atol=1e-5)
    assert packed_kernel_pays(4, 4) and not packed_kernel_pays(5, 4)
    assert not packed_kernel_pays(1, 0)


def test_a_weight_over_the_scratch_runs_block_by_block_with_the_same_result(
    kernels: KernelSet,
) -> None:
    with pytest.raises(ValueError, match="one k"):
        cat_rows([_packed(WeightType.Q4_0, 8, 64, 12), _packed(WeightType.Q6_K, 8, 256, 13)])
    parts = [_packed(WeightType.Q4_0, 200, 256, 12), _packed(WeightType.Q6_K, 120, 256, 13)]
    weight = cat_rows(parts)
    assert isinstance(weight, PackedWeight)
    whole = QuantLinear(weight, kernels, scratch=DequantScratch(torch.float32), max_packed_tokens=0)
    blocks = QuantLinear(
        weight, kernels, scratch=DequantScratch(torch.float32, 128 * 256), max_packed_tokens=0
    )
    assert whole.max_dense_rows == 320 and blocks.max_dense_rows == 128  # blocks cross parts
    x = _random(9, 256, seed=14)
    a, b = whole(x), blocks(x)
    assert b.is_contiguous() and b.shape == (9, 320)
    w = weight.dequantize()
    for got in (a, b):
        assert ((got.double() - x.double() @ w.double().t()).abs() <= _fp32_bound(x, w)).all()


def test_embeddings_are_looked_up_in_the_packed_rows_as_stored(kernels: KernelSet) -> None:
    table = _packed(WeightType.Q8_0, 50, 64, 15)
    embedding = PackedEmbedding(table.parts[0], kernels, torch.float32)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(embedding(ids), table.dequantize()[ids])


def test_packed_weights_are_named_by_their_types() -> None:
    assert weights_name([WeightType.Q6_K, WeightType.Q4_K, WeightType.Q6_K]) == "Q4_K+Q6_K"
    assert weights_name([WeightType.Q4_1]) == "Q4_1"


def test_the_bundled_models_blocks_dequantize_as_gguf_does(kernels: KernelSet) -> None:
    reader = open_gguf(default_model_path())
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1
    stored = Blocks(WeightType.Q4_1, torch.from_numpy(np.array(tensor.data)), int(tensor.shape[0]))
    assert stored.shape == (576, 576)
    want = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type)))
    got = ops.dequantize(kernels, stored, (0, 576), torch.empty(576, 576))
    assert torch.equal(got, want)


# {rows: (packed ms, dense ms)}: one decoder layer's matmuls, the int4 kernel against dense
# fp32 weights (the dense path before it dequantized to bf16), one torch thread, on a 2-core
# AVX2 EPYC shared with other work (2026-12-01).
AVX2_INT4 = {
    1: (0.62, 1.23),
    2: (0.78, 1.72),
    4: (1.01, 2.32),
    8: (1.70, 2.45),
    16: (3.41, 3.59),
    32: (6.66, 4.98),
    64: (11.69, 7.61),
    128: (23.87, 12.72),
}


@pytest.mark.parametrize(
    ("times", "crossover"),
    [
        (AVX2_INT4, 16),
        ({1: (2.0, 1.0), 8: (3.0, 2.0)}, 0),  # never pays: always dense
        ({1: (1.0, 2.0), 8: (1.0, 2.0), 128: (1.0, 2.0)}, 128),
        ({1: (1.0, 2.0), 8: (3.0, 2.0), 16: (1.0, 9.0)}, 1),  # a later win after a loss: noise
        ({1: (1.0, 2.0), 8: (1.05, 1.0), 16: (2.0, 1.0)}, 8),  # a near tie: the native product
    ],
)
def test_the_crossover_is_the_most_rows_up_to_which_packed_always_won(
    times: dict[int, tuple[float, float]], crossover: int
) -> None:
    assert pick_max_packed_tokens(times) == crossover


def test_the_crossover_trial_returns_a_tried_row_count_or_zero(kernels: KernelSet) -> None:
    layer = [_packed(WeightType.Q4_1, 96, 64, 16), _packed(WeightType.Q4_1, 64, 96, 17)]
    assert measured_max_packed_tokens(layer, kernels, torch.float32) in (0, *TRIAL_ROWS)
    assert max(TRIAL_ROWS) < NO_CROSSOVER
