"""The Triton cache ops against the torch reference, under the interpreter.

Pools start from random values with NaN in some blocks; every op is applied to a copy by the
reference as well, and the whole pools must then be bit-identical (NaN where NaN).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference, triton_cache_ops
from kernels.triton_backend import TritonBackend

pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_pool(
    layers: int, blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:  # [L, 2, N, bs, H, D]
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(layers, 2, blocks, block_size, heads, dim, generator=gen)
    pool[:, :, ::3] = math.nan  # marks blocks an op must leave alone, or copy as they are
    return pool.to(dtype)


def assert_identical(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "dim", "block_size"), [(3, 64, 16), (2, 128, 8), (1, 64, 64)])
def test_write_kv_matches_reference(
    dtype: torch.dtype, heads: int, dim: int, block_size: int
) -> None:
    # The caches are one layer's views of a pool: block stride != block_size x heads x dim.
    pool = make_pool(2, 7, block_size, heads, dim, dtype, seed=1)
    expected = pool.clone()
    gen = torch.Generator().manual_seed(2)
    slots = torch.randperm(7 * block_size, generator=gen)[:11]
    key = torch.randn(11, heads, dim, generator=gen).to(dtype)
    value = torch.randn(11, heads, dim, generator=gen).to(dtype)
    TritonBackend().write_kv(key, value, pool[1, 0], pool[1, 1], slots)
    reference.write_kv(key, value, expected[1, 0], expected[1, 1], slots)
    assert_identical(pool, expected)


def test_write_kv_casts_and_reads_strided_rows() -> None:
    """fp32 projections into a bf16 cache, K and V as slices of a fused QKV output."""
    pool = make_pool(1, 5, 16, 2, 64, torch.bfloat16, seed=3)
    expected = pool.clone()
    fused = torch.randn(6, 8, 64)  # [T, q + k + v heads, D]
    key, value = fused[:, 4:6], fused[:, 6:8]
    slots = torch.tensor([0, 17, 33, 34, 79, 50])
    TritonBackend().write_kv(key, value, pool[0, 0], pool[0, 1], slots)
    reference.write_kv(key, value, expected[0, 0], expected[0, 1], slots)
    assert_identical(pool, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_reference(dtype: torch.dtype) -> None:
    pool = make_pool(3, 12, 8, 3, 64, dtype, seed=4)
    expected = pool.clone()
    src, dst = torch.tensor([3, 1, 7, 3]), torch.tensor([10, 2, 5, 11])
    TritonBackend().copy_blocks(pool, src, dst)
    reference.copy_blocks(expected, src, dst)
    assert_identical(pool, expected)


def test_copy_blocks_within_a_strided_pool() -> None:
    """A pool that is itself a view (every other block of a larger tensor)."""
    big = make_pool(2, 16, 16, 2, 64, torch.float16, seed=5)
    pool = big[:, :, ::2]
    expected = big.clone()
    src, dst = torch.tensor([0, 5]), torch.tensor([6, 1])
    TritonBackend().copy_blocks(pool, src, dst)
    reference.copy_blocks(expected[:, :, ::2], src, dst)
    assert_identical(big, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_matches_reference(dtype: torch.dtype) -> None:
    src_pool = make_pool(2, 9, 16, 3, 64, dtype, seed=6)
    dst_pool = make_pool(2, 5, 16, 3, 64, dtype, seed=7)
    expected = dst_pool.clone()
    src, dst = torch.tensor([8, 0, 4]), torch.tensor([1, 4, 0])
    TritonBackend().swap_blocks(src_pool, dst_pool, src, dst)
    reference.swap_blocks(src_pool, expected, src, dst)
    assert_identical(dst_pool, expected)


def test_gather_then_scatter_round_trips_blocks() -> None:
    pool = make_pool(2, 6, 8, 2, 64, torch.float32, seed=8)
    ids = torch.tensor([5, 2], dtype=torch.int32)
    staged = triton_cache_ops.gather_blocks(pool, ids)
    assert staged.is_contiguous()
    assert_identical(staged, pool[:, :, ids.long()])
    other = torch.zeros_like(pool)
    triton_cache_ops.scatter_blocks(staged, other, torch.tensor([0, 3]))
    assert_identical(other[:, :, [0, 3]], pool[:, :, [5, 2]])
    assert other[:, :, [1, 2, 4, 5]].eq(0).all()


def test_cache_ops_without_interpreter_use_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_cache_ops, "INTERPRETER", False)
    pool = make_pool(2, 6, 8, 2, 64, torch.float32, seed=9)
    expected = pool.clone()
    backend = TritonBackend()
    backend.copy_blocks(pool, torch.tensor([1]), torch.tensor([4]))
    reference.copy_blocks(expected, torch.tensor([1]), torch.tensor([4]))
    other, other_expected = torch.zeros_like(pool), torch.zeros_like(pool)
    backend.swap_blocks(pool, other, torch.tensor([4, 0]), torch.tensor([2, 5]))
    reference.swap_blocks(expected, other_expected, torch.tensor([4, 0]), torch.tensor([2, 5]))
    key = torch.randn(3, 2, 64)
    backend.write_kv(key, key, pool[0, 0], pool[0, 1], torch.tensor([1, 9, 40]))
    reference.write_kv(key, key, expected[0, 0], expected[0, 1], torch.tensor([1, 9, 40]))
    assert_identical(pool, expected)
    assert_identical(other, other_expected)


@pytest.mark.parametrize("layout", ["contiguous", "every_other_block", "layers_unmergeable"])
def test_torch_gather_handles_pool_views(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    monkeypatch.setattr(triton_cache_ops, "INTERPRETER", False)
    base = make_pool(3, 12, 8, 2, 64, torch.float16, seed=12)
    pool = {
        "contiguous": base,
        "every_other_block": base[:, :, ::2],
        "layers_unmergeable": base.transpose(0, 1).contiguous().transpose(0, 1),
    }[layout]
    ids = torch.tensor([4, 0, 5])
    assert_identical(triton_cache_ops.gather_blocks(pool, ids), pool[:, :, ids])


def test_empty_batches_are_no_ops() -> None:
    pool = make_pool(1, 4, 8, 1, 64, torch.float32, seed=10)
    expected = pool.clone()
    none = torch.zeros(0, dtype=torch.int64)
    backend = TritonBackend()
    backend.copy_blocks(pool, none, none)
    backend.swap_blocks(pool, pool.clone(), none, none)
    backend.write_kv(torch.zeros(0, 1, 64), torch.zeros(0, 1, 64), pool[0, 0], pool[0, 1], none)
    assert_identical(pool, expected)


@pytest.fixture
def pool() -> torch.Tensor:
    return make_pool(2, 6, 8, 2, 64, torch.float32, seed=11)


def test_write_kv_rejects_bad_inputs(pool: torch.Tensor) -> None:
    key = torch.randn(2, 2, 64)
    kc, vc = pool[0, 0], pool[0, 1]
    write = triton_cache_ops.write_kv
    with pytest.raises(ValueError, match="slot_mapping holds"):
        write(key, key, kc, vc, torch.tensor([0, 6 * 8]))
    with pytest.raises(ValueError, match="slot_mapping holds"):
        write(key, key, kc, vc, torch.tensor([-1, 3]))
    with pytest.raises(ValueError, match="key must be"):
        write(key[:, :1], key, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="tokens"):
        write(key, key, kc, vc, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="int32/int64"):
        write(key, key, kc, vc, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="dtype"):
        write(key, key, kc.to(torch.int16), vc.to(torch.int16), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="differ in shape or dtype"):
        write(key, key, kc, vc.half(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        write(key.transpose(1, 2).contiguous().transpose(1, 2), key, kc, vc, torch.tensor([0, 1]))


def test_copy_blocks_rejects_bad_ids(pool: torch.Tensor) -> None:
    copy = triton_cache_ops.copy_blocks
    with pytest.raises(ValueError, match=r"outside 0\.\.5"):
        copy(pool, torch.tensor([1]), torch.tensor([6]))
    with pytest.raises(ValueError, match=r"outside 0\.\.5"):
        copy(pool, torch.tensor([-1]), torch.tensor([2]))
    with pytest.raises(ValueError, match="differ in length"):
        copy(pool, torch.tensor([1, 2]), torch.tensor([3]))
    with pytest.raises(ValueError, match="distinct"):
        copy(pool, torch.tensor([1, 2]), torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="also a src"):
        copy(pool, torch.tensor([1, 2]), torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="1-D int32/int64"):
        copy(pool, torch.tensor([[1]]), torch.tensor([[2]]))


def test_pool_ops_reject_bad_layouts(pool: torch.Tensor) -> None:
    ids = torch.tensor([1])
    with pytest.raises(ValueError, match="layers, 2"):
        triton_cache_ops.copy_blocks(pool[0], ids, torch.tensor([2]))
    with pytest.raises(ValueError, match="blocks must be contiguous"):
        triton_cache_ops.copy_blocks(pool.transpose(3, 4), ids, torch.tensor([2]))
    with pytest.raises(ValueError, match="differ in dtype"):
        triton_cache_ops.swap_blocks(pool, pool.half(), ids, ids)
    with pytest.raises(ValueError, match="differ in layout"):
        triton_cache_ops.swap_blocks(pool, pool[:1].clone(), ids, ids)
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        triton_cache_ops.swap_blocks(pool, pool[:, :, :2].clone(), ids, torch.tensor([2]))
