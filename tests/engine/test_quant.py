"""Packed weights: GGUF Q4 blocks mapped exactly, and the kernels within their roundings
(bf16 for torch's, two int8 digits an input for the VNNI one)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import native
from service.engine.loader import default_model_path, open_gguf
from service.engine.quant import (
    GROUP_SIZE,
    NO_CROSSOVER,
    TRIAL_ROWS,
    DequantScratch,
    Int4Weight,
    PackedEmbedding,
    QuantLinear,
    cat_rows,
    dense,
    gguf_int4,
    measured_max_packed_tokens,
    packed_kernel_pays,
    pick_max_packed_tokens,
    quantize_int4,
    quantize_int8,
)
from tests.quant_bounds import int8_input_bound

CPU = torch.device("cpu")
Q4_0, Q4_1, Q8_0 = (
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
    gguf.GGMLQuantizationType.Q8_0,
)
# The kernels round the input, the scales and the zeros to bf16 (8 significant bits): per
# output at most 3 * 2^-9 of sum_k |x_k w_k|, plus 2^-9 of |y| for the bf16 output.
BF16_EPS = 2.0**-9


def _random(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", [Q4_0, Q4_1], ids=["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_map_exactly_onto_int4_with_scales_and_zeros(
    kind: gguf.GGMLQuantizationType,
) -> None:
    w = _random(48, 128).numpy()
    blocks = gguf.quants.quantize(w, kind)  # [N, bytes per row]
    int4 = gguf_int4(blocks, kind)
    assert int4 is not None
    assert int4.q.dtype == torch.uint8 and int(int4.q.max()) <= 15
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, kind))
    assert torch.equal(int4.dequantize(), expected)


def test_other_gguf_types_are_not_taken_as_int4() -> None:
    blocks = gguf.quants.quantize(_random(4, 64).numpy(), Q8_0)
    assert gguf_int4(blocks, Q8_0) is None


@pytest.mark.real_model
def test_the_bundled_models_q4_1_tensor_maps_exactly() -> None:
    reader = open_gguf(default_model_path())
    tensor = next(t for t in reader.tensors if t.name == "blk.7.ffn_down.weight")
    int4 = gguf_int4(tensor.data, tensor.tensor_type)
    assert int4 is not None
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    assert torch.equal(int4.dequantize(), torch.from_numpy(expected))


def _matmul_bound(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 3 * BF16_EPS * (x.abs() @ w.abs().T) + BF16_EPS * y.abs() + 1e-6


@pytest.mark.parametrize("batch", [1, 5, 64])
def test_int4_kernel_equals_the_dequantized_matmul_within_bf16_rounding(batch: int) -> None:
    blocks = gguf.quants.quantize(_random(96, 256, seed=1).numpy(), Q4_1)
    int4 = gguf_int4(blocks, Q4_1)
    assert int4 is not None
    w = int4.dequantize()  # [N, K] exact, fp32
    x = _random(batch, 256, seed=2)
    layer = QuantLinear(int4, CPU)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (batch, 96)
    ref = x @ w.T
    if layer.vnni:  # two int8 digits per input, against bf16 scales and zeros
        bound = int8_input_bound(x, _stored_int4(int4)) + 2 * BF16_EPS * (x.abs() @ w.abs().T)
    else:
        bound = _matmul_bound(x, w, ref)
    assert bool(((y - ref).abs() <= bound).all())


def test_int8_kernel_equals_the_dequantized_matmul_within_bf16_rounding() -> None:
    int8 = quantize_int8(_random(80, 192, seed=3))
    w = int8.dequantize()
    x = _random(7, 192, seed=4)
    y = QuantLinear(int8, CPU)(x)
    ref = x @ w.T
    assert bool(((y - ref).abs() <= _matmul_bound(x, w, ref)).all())


def test_quantizing_rounds_each_weight_to_its_nearest_step() -> None:
    w = _random(16, 4 * GROUP_SIZE, seed=5)
    int4 = quantize_int4(w)
    step = int4.scale.repeat_interleave(GROUP_SIZE, dim=1)  # [N, K]
    assert bool(((int4.dequantize() - w).abs() <= step / 2 + 1e-6).all())
    int8 = quantize_int8(w)
    assert bool(((int8.dequantize() - w).abs() <= int8.scale[:, None] / 2 + 1e-6).all())


def test_rows_stacked_packed_dequantize_as_the_stacked_rows() -> None:
    a, b = quantize_int4(_random(8, 64, seed=6)), quantize_int4(_random(4, 64, seed=7))
    both = cat_rows([a, b])
    assert isinstance(both, Int4Weight)
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    mixed = cat_rows([a, _random(4, 64, seed=8)])  # formats differ: dense
    assert torch.equal(dense(mixed)[:8], a.dequantize())
    flipped = a.map_rows(lambda t: t.flip(0))
    assert torch.equal(flipped.dequantize(), a.dequantize().flip(0))


def _dense_path_bound(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # The dense path rounds the input and the dequantized weight to bf16 (w from the bf16
    # scale and zero pairs it is stored with), accumulates in fp32 and rounds the output.
    return 2 * BF16_EPS * (x.abs() @ w.abs().T) + BF16_EPS * y.abs() + 1e-6


def _stored_int4(int4: Int4Weight) -> torch.Tensor:
    """The weight as QuantLinear stores it: scales and zeros rounded to bf16."""
    rounded = Int4Weight(int4.q, int4.scale.bfloat16().float(), int4.zero.bfloat16().float())
    return rounded.dequantize()


@pytest.mark.skipif(native.library() is None, reason="no C compiler: no dense path")
def test_steps_above_the_crossover_dequantize_and_run_a_dense_bf16_matmul() -> None:
    int4 = quantize_int4(_random(64, 128, seed=9))
    w = _stored_int4(int4)
    layer = QuantLinear(int4, CPU, scratch=DequantScratch(), max_packed_tokens=4)
    packed_only = QuantLinear(int4, CPU, max_packed_tokens=NO_CROSSOVER)
    small, large = _random(4, 128, seed=10), _random(5, 128, seed=11)
    assert torch.equal(layer(small), packed_only(small))  # the kernel
    dense_out = layer(large)
    assert torch.equal(dense_out, F.linear(large.bfloat16(), w.bfloat16()).float())
    ref = large @ w.T
    assert bool(((dense_out - ref).abs() <= _dense_path_bound(large, w, ref)).all())
    assert packed_kernel_pays(4, 4) and not packed_kernel_pays(5, 4)
    assert not packed_kernel_pays(1, 0)


@pytest.mark.skipif(native.library() is None, reason="no C compiler: no dense path")
@pytest.mark.parametrize("bits", [4, 8])
def test_a_weight_over_the_scratch_runs_block_by_block_with_the_same_result(bits: int) -> None:
    w = _random(320, 64, seed=12)  # 5 tiles of 64 output rows
    packed = quantize_int4(w) if bits == 4 else quantize_int8(w)
    whole = QuantLinear(packed, CPU, scratch=DequantScratch())
    blocks = QuantLinear(packed, CPU, scratch=DequantScratch(max_elements=128 * 64))
    assert whole.max_dense_rows == 320 and blocks.max_dense_rows == 128
    x = _random(9, 64, seed=13)
    a, b = whole(x), blocks(x)
    assert b.is_contiguous() and b.shape == (9, 320)
    ref = x @ dense(packed).T
    bound = _dense_path_bound(x, dense(packed), ref) + 2 * BF16_EPS * ref.abs()
    assert bool(((a - b).abs() <= bound).all())


def test_embeddings_are_looked_up_in_the_lm_heads_int8_rows() -> None:
    int8 = quantize_int8(_random(50, 64, seed=14))
    head = QuantLinear(int8, CPU)
    embedding = PackedEmbedding(head, torch.float32)
    ids = torch.tensor([3, 0, 49, 3])
    stored = int8.q.float() * int8.scale.bfloat16().float()[:, None]  # bf16 scales, as kept
    assert torch.equal(embedding(ids), stored[ids])
    assert embedding.packed.data_ptr() == head.packed.data_ptr()  # one table, not two
    with pytest.raises(ValueError, match="int8"):
        PackedEmbedding(QuantLinear(quantize_int4(_random(64, 64)), CPU), torch.float32)


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
    ],
)
def test_the_crossover_is_the_most_rows_up_to_which_packed_always_won(
    times: dict[int, tuple[float, float]], crossover: int
) -> None:
    assert pick_max_packed_tokens(times) == crossover


def test_the_crossover_trial_returns_a_tried_row_count_or_zero() -> None:
    expected = (0, *TRIAL_ROWS) if native.library() is not None else (NO_CROSSOVER,)
    assert measured_max_packed_tokens(4) in expected


def _random_q4_k(n: int, k: int, seed: int) -> np.ndarray:
    """Valid Q4_K rows: random six-bit pairs and nibbles under small positive fp16 d, dmin."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    for start in (0, 2):  # d and dmin
        half = rng.uniform(1e-3, 1e-1, size=(n, k // 256)).astype(np.float16)
        blocks[..., start : start + 2] = half[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def test_gguf_q4_k_blocks_map_onto_int4_with_the_same_values() -> None:
    blocks = _random_q4_k(8, 512, seed=15)
    int4 = gguf_int4(blocks, gguf.GGMLQuantizationType.Q4_K)
    assert int4 is not None and int4.q.shape == (8, 512) and int4.scale.shape == (8, 16)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K))
    # The zero rounds once in fp32 (8 d sc - dmin m), so within 2 ulps of the largest value.
    assert torch.allclose(int4.dequantize(), expected, rtol=0, atol=2e-7 * expected.abs().max())
