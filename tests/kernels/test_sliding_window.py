"""Sliding-window attention through the paged cache: the torch reference's plan, the CPU decode
kernel of every version and the Triton kernel (under the interpreter), each against a dense
oracle that masks each query's keys to the `window` ending at its own position.

The batches are those of test_triton_attention (blocks in shuffled order, unowned blocks NaN), so
a read outside a sequence's window that lands on a foreign block shows as NaN, and one inside
its own blocks as a wrong value.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from kernels.attention_launch import LaunchTuning
from kernels.backend import TorchBackend
from kernels.cpu.dispatch import KernelSet
from kernels.triton_backend import TritonBackend
from tests.cpu_isa import cpu, cpu_isa
from tests.kernels.test_triton_attention import TOL, Batch, make_batch, rel_err

__all__ = ["cpu", "cpu_isa"]

# (query_len, seq_len): decode rows inside and past the window, a whole prompt longer than it,
# a chunk over a cached prefix that starts past it, and one that straddles its edge.
LENS = [(1, 5), (1, 40), (1, 131), (50, 50), (12, 90), (20, 37), (3, 70)]
WINDOWS = [1, 7, 16, 33, 200]


def oracle(batch: Batch, scale: float, window: int | None) -> torch.Tensor:
    """Each sequence's K/V read contiguous through its table, attended in float64 under an
    explicit causal-and-window mask."""
    meta = batch.meta
    bs = meta.block_size
    out = []
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        pos = torch.arange(s_len)
        blocks = meta.block_tables[i].long()[pos // bs]
        k = batch.key_cache[blocks, pos % bs].double().transpose(0, 1)  # [Hkv, S, D]
        v = batch.value_cache[blocks, pos % bs].double().transpose(0, 1)
        q = batch.query[start : start + q_len].double().transpose(0, 1)  # [Hq, Q, D]
        q_pos = torch.arange(s_len - q_len, s_len)
        mask = pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= pos[None, :] > q_pos[:, None] - window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out.append(o.transpose(0, 1))
        start += q_len
    return torch.cat(out)


def _batch(dtype: torch.dtype, *, block_size: int = 8, seed: int = 3, lens=LENS) -> Batch:
    return make_batch(
        lens, q_heads=6, kv_heads=2, head_dim=64, block_size=block_size, dtype=dtype, seed=seed
    )


@pytest.mark.parametrize("window", WINDOWS)
def test_the_reference_sees_only_each_querys_window(window: int) -> None:
    batch = _batch(torch.float32)
    plan = reference.plan_attention(batch.meta).windowed(window)
    assert plan.window == window
    out = reference.paged_attention(batch.query, batch.key_cache, batch.value_cache, plan, 0.125)
    assert rel_err(out, oracle(batch, 0.125, window)) <= TOL[torch.float32]


def test_a_window_gathers_no_key_outside_it() -> None:
    """Decode rows gather only their window's slots (what the CPU kernel reads in place), and a
    chunk's keys start at its first query's window."""
    batch = _batch(torch.float32, lens=[(1, 131), (1, 5), (12, 90)])
    plan = reference.plan_attention(batch.meta, window=16)
    assert plan.decode is not None
    assert plan.decode.seq_lens.tolist() == [16, 5]
    assert plan.decode.blocks.shape[1] == 16
    (chunk,) = plan.prefills
    assert chunk.slots.shape[0] == 90 - (90 - 12 - 16 + 1)


def test_every_layer_shares_one_plan_per_window() -> None:
    plan = reference.plan_attention(_batch(torch.float32).meta)
    assert plan.windowed(None) is plan
    assert plan.windowed(16) is plan.windowed(16)
    assert plan.windowed(16).windowed(None) is not plan.windowed(16)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_cpu_decode_kernel_reads_only_the_window(
    cpu: KernelSet, cache_dtype: torch.dtype
) -> None:
    """Every kernel version, through the CPU backend: decode rows in place, chunks by SDPA."""
    batch = _batch(torch.float32, seed=5)
    caches = batch.key_cache.to(cache_dtype), batch.value_cache.to(cache_dtype)
    backend = TorchBackend(cpu)
    plan = backend.plan(batch.meta)
    for window in (7, 33):
        out = backend.attend(batch.query, *caches, batch.meta, plan, 0.125, window)
        rounded = Batch(batch.meta, batch.pool.to(cache_dtype).float(), batch.query, batch.layer)
        assert rel_err(out, oracle(rounded, 0.125, window)) <= TOL[torch.float32]


TUNINGS = [
    LaunchTuning(),
    LaunchTuning(skip_masks=False),
    LaunchTuning(tile_n=16, num_splits=4),
    LaunchTuning(tile_n=32, num_splits=2),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [1, 16, 33])
@pytest.mark.parametrize("tuning", TUNINGS, ids=repr)
def test_the_triton_kernel_sees_only_each_querys_window(tuning: LaunchTuning, window: int) -> None:
    batch = _batch(torch.float32, block_size=16, seed=7)
    backend = TritonBackend(tuning=tuning)
    plan = backend.plan(batch.meta)
    out = torch.full_like(batch.query, float("nan"))
    backend.attend(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, plan, 0.125, window, out=out
    )
    assert rel_err(out, oracle(batch, 0.125, window)) <= TOL[torch.float32]


@pytest.mark.interpreter
@pytest.mark.parametrize("seed", range(4))
def test_random_windowed_batches_in_16_bit_match_the_oracle(seed: int) -> None:
    rng = random.Random(seed)
    lens = []
    for _ in range(rng.randint(1, 4)):
        seq_len = rng.randint(1, 120)
        lens.append((1 if rng.random() < 0.5 else rng.randint(1, min(seq_len, 24)), seq_len))
    dtype = rng.choice([torch.bfloat16, torch.float16])
    batch = _batch(dtype, block_size=rng.choice([8, 16, 32]), seed=seed, lens=lens)
    window = rng.randint(1, 64)
    backend = TritonBackend(split_kv=rng.choice([None, 2, 4]))
    plan = backend.plan(batch.meta)
    out = backend.attend(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, plan, 0.125, window
    )
    assert rel_err(out, oracle(batch, 0.125, window)) <= TOL[dtype]
