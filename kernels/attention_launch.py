"""How one paged-attention launch is cut: tiles, grid, split-KV, pipeline, registers.

Host arithmetic only, from sizes the host already knows (no device sync): `choose_launch`
picks an `AttentionLaunch` per step and head shape, `LaunchTuning` overrides any pick (GPU
sweeps time them, benchmarks/kernels.py --sweep), `split_scratch` sizes the split-KV partial
results. The kernels that take these are in `kernels.triton_attention`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

# Split-KV policy, tuned on an H200 (132 SMs) with CUDA-graph timings of decode batches:
# splits double while the doubled grid still fits in about one wave of resident programs
# (4 per SM at head_dim 128, 8 at 64, whose programs are lighter) and each split keeps at
# least one 64-token tile; more waves or thinner splits measured slower.
MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 64


@dataclass(slots=True, frozen=True)
class AttentionLaunch:
    """Tiling, grid and split count of one attention launch (host arithmetic only)."""

    group: int  # query heads per KV head
    block_m: int  # rows per program: block_q tokens x group heads, padded to a power of two
    block_q: int
    tile_n: int  # context tokens per inner-loop step
    num_q_blocks: int  # grid dim 0 (an upper bound when a sequence has several tokens)
    num_splits: int
    one_token_per_seq: bool
    num_warps: int
    num_stages: int
    skip_masks: bool = True  # whole tiles every row sees skip the bounds and causal masks
    narrow_offsets: bool = True  # int32 cache offsets where the cache is small enough
    # Registers per thread the compiler may use (ptxas maxnreg); None: its own choice. A cap
    # can buy the occupancy the split policy assumes (4 programs per SM at head_dim 128).
    max_registers: int | None = None


@dataclass(slots=True, frozen=True)
class LaunchTuning:
    """Overrides of `choose_launch`'s picks, for sweeps on a GPU; None keeps the pick."""

    tile_n: int | None = None
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    skip_masks: bool | None = None
    narrow_offsets: bool | None = None
    max_registers: int | None = None

    def __post_init__(self) -> None:
        for name in ("tile_n", "num_splits", "num_warps"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.tile_n is not None and self.tile_n < 16:
            raise ValueError(f"tile_n must be at least 16 (tl.dot), got {self.tile_n}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"num_stages must be at least 1, got {self.num_stages}")
        if self.max_registers is not None and not 24 <= self.max_registers <= 255:
            raise ValueError(f"max_registers must be in 24..255, got {self.max_registers}")

    def apply(self, launch: AttentionLaunch) -> AttentionLaunch:
        picks = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(launch, **{k: v for k, v in picks.items() if v is not None})


def choose_launch(
    *,
    num_tokens: int,
    num_seqs: int,
    max_query_len: int,
    max_seq_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_sms: int,
    tuning: LaunchTuning | None = None,
) -> AttentionLaunch:
    """Pick tiles and split-KV for a batch; `tuning` overrides any pick."""
    group = num_q_heads // num_kv_heads
    fp32 = dtype == torch.float32
    one_token = max_query_len == 1
    # Prefill rows want a taller tile for the tensor cores, short chunks a smaller one. fp32
    # dots run on the FMA units (true fp32) and spill registers past 16 rows: fp32 stays at 16.
    max_rows = 16 if one_token or fp32 else 64
    want = min(max_rows, triton.next_power_of_2(max_query_len * group))
    block_m = max(16, want, triton.next_power_of_2(group))
    if one_token:
        block_q = 1
        num_q_blocks = num_seqs
    else:
        block_q = block_m // group
        num_q_blocks = num_tokens // block_q + num_seqs
    # fp32 tiles are twice the bytes: half the tokens keep shared memory per stage alike.
    tile_n = 32 if fp32 else 64
    per_sm = 8 if head_dim <= 64 else 4
    num_splits = _split_count(num_q_blocks * num_kv_heads, max_seq_len, per_sm * num_sms)
    launch = AttentionLaunch(
        group=group,
        block_m=block_m,
        block_q=block_q,
        tile_n=tile_n,
        num_q_blocks=num_q_blocks,
        num_splits=num_splits,
        one_token_per_seq=one_token,
        num_warps=8 if fp32 else 4,
        # A third stage paid off for head_dim 128 and for prefill tiles; not at 64 in decode.
        num_stages=3 if head_dim >= 128 or not one_token else 2,
    )
    return launch if tuning is None else tuning.apply(launch)


def _split_count(programs: int, max_seq_len: int, resident: int) -> int:
    """Double the splits while the doubled grid fits in `resident` programs (one wave)."""
    splits = 1
    while (
        splits < MAX_SPLITS
        and 2 * programs * splits <= resident
        and max_seq_len >= 2 * splits * MIN_TOKENS_PER_SPLIT
    ):
        splits *= 2
    return splits


def split_scratch(
    num_tokens: int, num_q_heads: int, head_dim: int, launch: AttentionLaunch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial results of split-KV: acc [T, Hq, S, D], m and l [T, Hq, S], all fp32.

    Without splits the kernel never touches them, and one-element placeholders stand in.
    """
    shape = (num_tokens, num_q_heads, launch.num_splits) if launch.num_splits > 1 else (1, 1, 1)
    head_dim = head_dim if launch.num_splits > 1 else 1
    part_out = torch.empty((*shape, head_dim), dtype=torch.float32, device=device)
    part_m = torch.empty(shape, dtype=torch.float32, device=device)
    part_l = torch.empty(shape, dtype=torch.float32, device=device)
    return part_out, part_m, part_l


def offsets_fit_int32(cache: torch.Tensor) -> bool:
    """Whether every element offset from the cache's base pointer fits in int32."""
    last = sum(
        (size - 1) * stride for size, stride in zip(cache.shape, cache.stride(), strict=True)
    )
    return last < 2**31
