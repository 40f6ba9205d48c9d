"""The Triton paged attention kernel against the torch reference, under the interpreter.

Every case builds a pool with blocks handed out in shuffled order, fills the blocks nobody owns
with NaN (block 0, which pads the block tables, among them) so that a read through a wrong
block id shows, and compares with the reference computed in float64 on the same inputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import zlib
from dataclasses import dataclass

import pytest
import torch

from kernels import reference, triton_cache_ops
from kernels.attention_launch import LaunchTuning, choose_launch, offsets_fit_int32
from kernels.metadata import AttentionMetadata
from kernels.triton_backend import TritonBackend

pytestmark = pytest.mark.interpreter

LAYERS = 2
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# (query_len, seq_len) per sequence: lengths off block multiples, a 1-token context, a prefill
# chunk over a cached prefix, and a context longer than one 64-token tile.
BATCHES = {
    "decode": [(1, 1), (1, 17), (1, 40), (1, 75)],
    "prefill": [(13, 13), (9, 41), (24, 24)],
    "mixed": [(1, 33), (12, 12), (1, 70), (7, 45)],
    # Several whole tiles before the causal diagonal or the tail: the unmasked phase. The
    # interpreter's time goes by query blocks, so the chunks stay short: 17 tokens (more than
    # one query block at every head shape and dtype here but fp16's 32-row blocks without
    # GQA) and 9 over a 291-token prefix, two whole tiles of 128 before the diagonal.
    "long": [(1, 200), (1, 128), (17, 230), (9, 300), (3, 65)],
}


@dataclass
class Batch:
    meta: AttentionMetadata
    pool: torch.Tensor  # [L, 2, N, bs, Hkv, D]
    query: torch.Tensor  # [T, Hq, D]
    layer: int

    @property
    def key_cache(self) -> torch.Tensor:
        return self.pool[self.layer, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.pool[self.layer, 1]


def make_batch(
    lens: list[tuple[int, int]],
    *,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(s / block_size) for _, s in lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
    # Block 0 pads the tables and is never handed out: reading it poisons the output.
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lens), max(blocks_per_seq), dtype=torch.int32)
    pool = torch.full((LAYERS, 2, num_blocks, block_size, kv_heads, head_dim), math.nan)
    slots: list[int] = []
    for i, ((q_len, s_len), n) in enumerate(zip(lens, blocks_per_seq, strict=True)):
        ids = [order.pop() for _ in range(n)]
        tables[i, :n] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(s_len):
            block, offset = ids[pos // block_size], pos % block_size
            pool[:, :, block, offset] = torch.randn(LAYERS, 2, kv_heads, head_dim, generator=gen)
            if pos >= s_len - q_len:
                slots.append(block * block_size + offset)
    q_lens = [q for q, _ in lens]
    s_lens = [s for _, s in lens]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
        seq_lens=torch.tensor(s_lens, dtype=torch.int32),
        block_tables=tables,
        block_size=block_size,
        query_lens_host=q_lens,
        seq_lens_host=s_lens,
    )
    query = torch.randn(sum(q_lens), q_heads, head_dim, generator=gen)
    return Batch(meta=meta, pool=pool.to(dtype), query=query.to(dtype), layer=1)


def reference_attention(batch: Batch, scale: float) -> torch.Tensor:
    """The reference in float64, with NaN turned to 0.

    The reference's padded decode positions read slots past a sequence's end (masked, but
    NaN * 0 is NaN), so it needs finite values there; the kernel must never read them.
    """
    plan = reference.plan_attention(batch.meta)
    k, v = (torch.nan_to_num(c.double(), nan=0.0) for c in (batch.key_cache, batch.value_cache))
    return reference.paged_attention(batch.query.double(), k, v, plan, scale)


def poisoned_attend(
    backend: TritonBackend, batch: Batch, scale: float, query: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention into a NaN-filled output, with NaN-filled split scratch: unwritten shows."""
    query = batch.query if query is None else query
    plan = backend.plan(batch.meta)
    _, scratch = plan.launch_for(
        query.shape[1], batch.key_cache.shape[2], query.shape[2], query.dtype
    )
    for t in scratch:
        t.fill_(math.nan)
    out = torch.full_like(query, math.nan)
    result = backend.attend(
        query, batch.key_cache, batch.value_cache, batch.meta, plan, scale, out=out
    )
    assert result is out
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


# kind, dtype, q heads, kv heads, head dim, block size, forced splits (None: heuristic)
CASES = [
    ("decode", torch.float32, 9, 3, 64, 16, None),
    ("decode", torch.bfloat16, 8, 1, 128, 8, None),
    ("decode", torch.float16, 4, 4, 64, 32, 4),
    ("decode", torch.float32, 8, 1, 64, 64, 2),
    ("prefill", torch.float32, 4, 4, 128, 64, None),
    ("prefill", torch.bfloat16, 9, 3, 64, 16, None),
    ("prefill", torch.float16, 8, 1, 64, 8, 2),
    ("mixed", torch.float32, 8, 1, 64, 32, 2),
    ("mixed", torch.bfloat16, 4, 4, 64, 64, None),
    ("mixed", torch.float16, 9, 3, 128, 16, None),
    ("mixed", torch.bfloat16, 6, 2, 64, 8, 4),
    ("long", torch.float32, 9, 3, 64, 16, None),
    ("long", torch.bfloat16, 8, 1, 128, 32, 2),
    ("long", torch.float16, 4, 4, 64, 8, 4),
]


@pytest.mark.parametrize(
    ("kind", "dtype", "q_heads", "kv_heads", "head_dim", "block_size", "split_kv"),
    CASES,
    ids=[f"{c[0]}-{str(c[1])[6:]}-gqa{c[2] // c[3]}-d{c[4]}-bs{c[5]}-split{c[6]}" for c in CASES],
)
def test_attention_matches_reference(
    kind: str,
    dtype: torch.dtype,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    split_kv: int | None,
) -> None:
    batch = make_batch(
        BATCHES[kind],
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=zlib.crc32(f"{kind}-{q_heads}-{head_dim}-{block_size}".encode()),
    )
    scale = head_dim**-0.5
    out = poisoned_attend(TritonBackend(split_kv=split_kv), batch, scale)
    assert out.dtype == dtype
    assert rel_err(out, reference_attention(batch, scale)) <= TOL[dtype]


@pytest.mark.parametrize("seed", range(10))
def test_random_batches_match_reference(seed: int) -> None:
    """Random mixes of decode tokens and prefill chunks over random shapes."""
    rng = random.Random(seed)
    lens = []
    for _ in range(rng.randint(1, 5)):
        seq_len = rng.randint(1, 90)
        query_len = 1 if rng.random() < 0.5 else rng.randint(1, min(seq_len, 24))
        lens.append((query_len, seq_len))
    group, kv_heads = rng.choice([(1, 2), (3, 1), (8, 1), (2, 2)])
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    head_dim = rng.choice([64, 128])
    batch = make_batch(
        lens,
        q_heads=group * kv_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=rng.choice([8, 16, 32, 64]),
        dtype=dtype,
        seed=seed,
    )
    backend = TritonBackend(split_kv=rng.choice([None, 1, 2, 8]))
    out = poisoned_attend(backend, batch, head_dim**-0.5)
    assert rel_err(out, reference_attention(batch, head_dim**-0.5)) <= TOL[dtype]


TUNINGS = [
    LaunchTuning(skip_masks=False),
    LaunchTuning(tile_n=16, num_warps=2),
    LaunchTuning(tile_n=128, num_stages=4, num_splits=2),
    LaunchTuning(tile_n=32, skip_masks=False, num_splits=4),
    LaunchTuning(narrow_offsets=False),
    LaunchTuning(max_registers=128, num_splits=2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tuning", TUNINGS, ids=repr)
def test_every_tuning_a_sweep_may_pick_is_correct(tuning: LaunchTuning, dtype: torch.dtype) -> None:
    """benchmarks/kernels.py --sweep times these overrides on a GPU; each must be exact here."""
    batch = make_batch(
        BATCHES["long"], q_heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=7
    )
    out = poisoned_attend(TritonBackend(tuning=tuning), batch, 0.125)
    assert rel_err(out, reference_attention(batch, 0.125)) <= TOL[dtype]


@pytest.mark.parametrize(
    ("tuning", "message"),
    [
        (dict(tile_n=48), "tile_n must be a power of two"),
        (dict(tile_n=8), "at least 16"),
        (dict(num_splits=0), "num_splits must be a power of two"),
        (dict(num_stages=0), "num_stages"),
        (dict(max_registers=300), "max_registers"),
    ],
)
def test_launch_tuning_rejects_what_a_gpu_cannot_run(tuning: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LaunchTuning(**tuning)  # type: ignore[arg-type]


def test_launch_tuning_overrides_only_what_it_names() -> None:
    args = dict(
        num_tokens=64, num_seqs=64, max_query_len=1, max_seq_len=4096, num_q_heads=32,
        num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, num_sms=132,
    )  # fmt: skip
    picked = choose_launch(**args)  # type: ignore[arg-type]
    tuned = choose_launch(**args, tuning=LaunchTuning(num_stages=4, skip_masks=False))  # type: ignore[arg-type]
    assert (tuned.num_stages, tuned.skip_masks) == (4, False)
    assert (tuned.tile_n, tuned.num_splits, tuned.num_warps) == (
        picked.tile_n, picked.num_splits, picked.num_warps,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_head_major_cache_reads_the_same_as_a_token_major_one(dtype: torch.dtype) -> None:
    """The kernel addresses the cache through its strides, so a pool laid out [N, Hkv, bs, D]
    (viewed as [N, bs, Hkv, D]) works as is; benchmarks/kernels.py --sweep times both."""
    batch = make_batch(
        BATCHES["long"], q_heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=11
    )
    head_major = dataclasses.replace(
        batch, pool=batch.pool.transpose(3, 4).contiguous().transpose(3, 4)
    )
    assert head_major.key_cache.stride() == (2 * 16 * 64, 64, 16 * 64, 1)
    out = poisoned_attend(TritonBackend(), head_major, 0.125)
    assert rel_err(out, reference_attention(batch, 0.125)) <= TOL[dtype]


def test_int32_offsets_only_where_every_offset_fits() -> None:
    """Past 2**31 elements a layer's cache needs int64 addressing (sizes only: meta tensors)."""
    per_block = 16 * 8 * 128
    fits = torch.empty((2**31 // per_block, 16, 8, 128), device="meta")
    too_big = torch.empty((2**31 // per_block + 1, 16, 8, 128), device="meta")
    assert offsets_fit_int32(fits)
    assert not offsets_fit_int32(too_big)
    # A K slice of a [L, 2, N, bs, H, D] pool: the offsets reach only across its own blocks.
    pool = torch.empty((4, 2, 2**31 // per_block, 16, 8, 128), device="meta")
    assert offsets_fit_int32(pool[3, 1])


def test_attention_reads_strided_query_view() -> None:
    """The query may be a slice of a fused QKV projection: only its last dim is contiguous."""
    batch = make_batch(
        BATCHES["mixed"], q_heads=4, kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=7,
    )  # fmt: skip
    tokens = batch.query.shape[0]
    fused = torch.randn(tokens, 8, 64)  # [T, q + k + v heads, D]
    fused[:, :4] = batch.query
    out = poisoned_attend(TritonBackend(), batch, 0.125, query=fused[:, :4])
    assert rel_err(out, reference_attention(batch, 0.125)) <= TOL[torch.float32]


def test_plan_is_shared_by_layers() -> None:
    """One plan serves every layer; the launch and scratch are built once per head shape."""
    batch = make_batch(
        BATCHES["decode"], q_heads=4, kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=11,
    )  # fmt: skip
    backend = TritonBackend(split_kv=2)
    plan = backend.plan(batch.meta)
    for layer in range(LAYERS):
        batch.layer = layer
        out = backend.attend(
            batch.query, batch.key_cache, batch.value_cache, batch.meta, plan, 0.125
        )
        assert rel_err(out, reference_attention(batch, 0.125)) <= TOL[torch.float32]
    assert len(plan.launches) == 1


def test_cpu_without_interpreter_falls_back_to_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(triton_cache_ops, "INTERPRETER", False)
    batch = make_batch(
        BATCHES["mixed"], q_heads=4, kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=3,
    )  # fmt: skip
    backend = TritonBackend()
    plan = backend.plan(batch.meta)
    assert plan.torch_plan is not None
    out = backend.attend(batch.query, batch.key_cache, batch.value_cache, batch.meta, plan, 0.125)
    assert rel_err(out, reference_attention(batch, 0.125)) <= TOL[torch.float32]


@pytest.fixture
def small_batch() -> Batch:
    return make_batch(
        [(1, 20), (5, 9)], q_heads=4, kv_heads=2, head_dim=64, block_size=8,
        dtype=torch.float32, seed=5,
    )  # fmt: skip


def _attend(batch: Batch, **override: torch.Tensor) -> torch.Tensor:
    backend = TritonBackend()
    plan = backend.plan(batch.meta)
    query = override.get("query", batch.query)
    key_cache = override.get("key_cache", batch.key_cache)
    value_cache = override.get("value_cache", batch.value_cache)
    return backend.attend(query, key_cache, value_cache, batch.meta, plan, 0.125)


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("query_head_dim", "query must be"),
        ("query_dtype", "share one of"),
        ("query_tokens", "tokens"),
        ("query_last_dim_strided", "contiguous in head_dim"),
        ("gqa_ratio", "multiple of kv_heads"),
        ("cache_last_dim_strided", "contiguous in head_dim"),
        ("cache_int_dtype", "dtype"),
        ("value_shape", "value_cache"),
        ("value_strides", "value_cache strides"),
    ],
)
def test_attend_rejects_bad_inputs(small_batch: Batch, what: str, message: str) -> None:
    q, k, v = small_batch.query, small_batch.key_cache, small_batch.value_cache
    bad = {
        "query_head_dim": {"query": q[..., :32]},
        "query_dtype": {"query": q.half()},
        "query_tokens": {"query": q[:-1]},
        "query_last_dim_strided": {"query": q.transpose(1, 2).contiguous().transpose(1, 2)},
        "gqa_ratio": {"query": q[:, :3]},
        "cache_last_dim_strided": {"key_cache": k.transpose(2, 3).contiguous().transpose(2, 3)},
        "cache_int_dtype": {"key_cache": k.to(torch.int32)},
        "value_shape": {"value_cache": v[:-1]},
        "value_strides": {"value_cache": v.transpose(0, 1).contiguous().transpose(0, 1)},
    }[what]
    with pytest.raises(ValueError, match=message):
        _attend(small_batch, **bad)


def test_attend_rejects_out_of_range_block_ids(small_batch: Batch) -> None:
    small_batch.meta.block_tables[0, 1] = small_batch.key_cache.shape[0]
    with pytest.raises(ValueError, match="block_tables hold ids"):
        _attend(small_batch)


def test_attend_rejects_cache_of_another_block_size(small_batch: Batch) -> None:
    k = small_batch.key_cache.reshape(-1, 16, 2, 64)
    with pytest.raises(ValueError, match="block size"):
        _attend(small_batch, key_cache=k, value_cache=k)


def test_plan_rejects_metadata_that_disagrees_with_host_copies(small_batch: Batch) -> None:
    small_batch.meta.seq_lens[1] = 8
    with pytest.raises(ValueError, match="seq_lens"):
        TritonBackend().plan(small_batch.meta)


def test_kernels_run_under_the_interpreter() -> None:
    """Were the kernels defined without it, the backend would fall back to the reference on
    the CPU and every comparison here would pass without running a kernel."""
    assert triton_cache_ops.INTERPRETER
    assert triton_cache_ops.kernels_run_on(torch.device("cpu"))


def test_split_kv_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        TritonBackend(split_kv=3)


@pytest.mark.parametrize(
    ("batch", "ctx", "q_heads", "kv_heads", "head_dim", "splits"),
    [
        (1, 512, 32, 8, 128, 8),
        (1, 16384, 32, 8, 128, 64),
        (16, 4096, 32, 8, 128, 4),
        (64, 4096, 32, 8, 128, 1),
        (16, 4096, 9, 3, 64, 16),
        (64, 4096, 9, 3, 64, 4),
        (256, 512, 9, 3, 64, 1),
    ],
)
def test_split_kv_fills_an_h200_in_one_wave(
    batch: int, ctx: int, q_heads: int, kv_heads: int, head_dim: int, splits: int
) -> None:
    """The split counts that measured fastest on an H200 (132 SMs) for decode batches."""
    launch = choose_launch(
        num_tokens=batch, num_seqs=batch, max_query_len=1, max_seq_len=ctx,
        num_q_heads=q_heads, num_kv_heads=kv_heads, head_dim=head_dim,
        dtype=torch.bfloat16, num_sms=132,
    )  # fmt: skip
    assert launch.num_splits == splits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7, 8, 16, 32])
@pytest.mark.parametrize("max_query_len", [1, 2, 7, 100])
def test_launch_shapes_suit_a_gpu(dtype: torch.dtype, group: int, max_query_len: int) -> None:
    """What the interpreter accepts but a GPU would not: tl.arange sizes that are not powers
    of two, dots under 16 rows or columns; and a grid that misses a query block."""
    lens = [max_query_len, 1, 3 * max_query_len]
    launch = choose_launch(
        num_tokens=sum(lens), num_seqs=3, max_query_len=max(lens), max_seq_len=5000,
        num_q_heads=2 * group, num_kv_heads=2, head_dim=64, dtype=dtype, num_sms=132,
    )  # fmt: skip
    for size in (launch.block_m, launch.tile_n, launch.num_splits):
        assert size & (size - 1) == 0
    assert launch.block_m >= 16 and launch.tile_n >= 16
    assert launch.block_q >= 1 and launch.block_q * group <= launch.block_m
    assert launch.num_q_blocks >= sum(-(-n // launch.block_q) for n in lens)


def test_interpreter_plans_never_split() -> None:
    batch = make_batch(
        BATCHES["decode"], q_heads=4, kv_heads=1, head_dim=64, block_size=16,
        dtype=torch.float32, seed=1,
    )  # fmt: skip
    plan = TritonBackend().plan(batch.meta)
    launch, _ = plan.launch_for(4, 1, 64, torch.float32)
    assert launch.num_splits == 1
