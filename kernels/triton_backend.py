"""The Triton attention backend: the GPU path, and the CPU one under TRITON_INTERPRET=1.

`plan` runs once per step and prepares what every layer's launch shares: int32 contiguous
index tensors and, per head shape (met at the first layer, then memoised), the tiling, grid,
split count and split-KV scratch. It never syncs with the device. Each call then validates its
tensors (shapes, last-dim strides, dtypes, devices, block-table bounds) and launches.

On CPU tensors without the interpreter Triton cannot run, and every call falls back to the
torch reference, so the backend works anywhere.

NOTE: block-id *values* are checked only when the ids live on the CPU: on a GPU that check
would cost a device-to-host sync per step. There the block manager's invariants are trusted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kernels import reference, triton_cache_ops
from kernels.attention_launch import AttentionLaunch, LaunchTuning, choose_launch, split_scratch
from kernels.metadata import AttentionMetadata
from kernels.triton_attention import launch_paged_attention
from kernels.triton_cache_ops import CACHE_DTYPES, check_cache, kernels_run_on

Scratch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
LaunchKey = tuple[int, int, int, torch.dtype, int | None]


@dataclass(slots=True)
class TritonAttentionPlan:
    meta: AttentionMetadata
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, contiguous
    num_sms: int
    tuning: LaunchTuning | None
    torch_plan: reference.TorchAttentionPlan | None  # set when falling back to the reference
    # (q heads, kv heads, head dim, dtype, window) -> launch and scratch; the layers of one
    # model share one entry per window, so it is built once per step.
    launches: dict[LaunchKey, tuple[AttentionLaunch, Scratch]] = field(default_factory=dict)

    def launch_for(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        window: int | None = None,
    ) -> tuple[AttentionLaunch, Scratch]:
        key = (num_q_heads, num_kv_heads, head_dim, dtype, window)
        if key not in self.launches:
            meta = self.meta
            # The most keys one program reads: a window bounds it for its first row.
            max_span = meta.max_seq_len
            if window is not None:
                max_span = min(max_span, window + meta.max_query_len - 1)
            launch = choose_launch(
                num_tokens=meta.num_tokens,
                num_seqs=meta.num_seqs,
                max_query_len=meta.max_query_len,
                max_seq_len=max_span,
                num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                dtype=dtype,
                num_sms=self.num_sms,
                tuning=self.tuning,
            )
            scratch = split_scratch(
                meta.num_tokens, num_q_heads, head_dim, launch, self.block_tables.device
            )
            self.launches[key] = (launch, scratch)
        return self.launches[key]


class TritonBackend:
    """Triton kernels for attention and cache ops, behind the `AttentionBackend` protocol."""

    name = "triton"

    def __init__(self, split_kv: int | None = None, tuning: LaunchTuning | None = None) -> None:
        """split_kv: force this many context splits (a power of two); None picks per step.
        tuning: override the launch picks (tile, warps, stages, masks), as sweeps do.
        split_kv is shorthand for a tuning of num_splits, and wins over the tuning's."""
        if split_kv is not None:
            tuning = dataclasses.replace(tuning or LaunchTuning(), num_splits=split_kv)
        self.tuning = tuning
        self._num_sms: dict[torch.device, int] = {}

    def plan(self, meta: AttentionMetadata) -> TritonAttentionPlan:
        device = meta.block_tables.device
        for name, t in (("query_start_loc", meta.query_start_loc), ("seq_lens", meta.seq_lens)):
            if t.device != device:
                raise ValueError(f"{name} is on {t.device}, block_tables on {device}")
        if meta.num_tokens != sum(meta.query_lens_host):
            raise ValueError(
                f"slot_mapping has {meta.num_tokens} tokens, query lengths sum to "
                f"{sum(meta.query_lens_host)}"
            )
        fallback = None if kernels_run_on(device) else reference.plan_attention(meta)
        if device.type == "cpu":
            _check_host_copies(meta)
        return TritonAttentionPlan(
            meta=meta,
            query_start_loc=meta.query_start_loc.to(torch.int32).contiguous(),
            seq_lens=meta.seq_lens.to(torch.int32).contiguous(),
            block_tables=meta.block_tables.to(torch.int32).contiguous(),
            num_sms=self._sm_count(device),
            tuning=self.tuning,
            torch_plan=fallback,
        )

    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        key_cache: torch.Tensor,  # [N, bs, Hkv, D]
        value_cache: torch.Tensor,  # [N, bs, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        if kernels_run_on(key_cache.device):
            triton_cache_ops.write_kv(key, value, key_cache, value_cache, slot_mapping)
        else:
            reference.write_kv(key, value, key_cache, value_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key_cache: torch.Tensor,  # [N, bs, Hkv, D]
        value_cache: torch.Tensor,  # [N, bs, Hkv, D]
        meta: AttentionMetadata,
        plan: TritonAttentionPlan,
        scale: float,
        window: int | None = None,  # keys each query sees, its own included; None: all
        out: torch.Tensor | None = None,  # [T, Hq, D]: where to write, else a new tensor
    ) -> torch.Tensor:  # [T, Hq, D]
        if plan.meta is not meta:
            raise ValueError("plan was made for another step's metadata")
        if window is not None and window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        if plan.torch_plan is not None:
            result = reference.paged_attention(
                query, key_cache, value_cache, plan.torch_plan.windowed(window), scale
            )
            return result if out is None else out.copy_(result)
        _check_attention_inputs(query, key_cache, value_cache, plan)
        num_tokens, num_q_heads, head_dim = query.shape
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
            raise ValueError(f"out must match the query ({tuple(query.shape)}, {query.dtype})")
        elif out.stride(2) != 1:
            raise ValueError("out must be contiguous in head_dim")
        launch, scratch = plan.launch_for(
            num_q_heads, key_cache.shape[2], head_dim, query.dtype, window
        )
        if num_tokens == 0:
            return out
        launch_paged_attention(
            out,
            query,
            key_cache,
            value_cache,
            plan.block_tables,
            plan.seq_lens,
            plan.query_start_loc,
            scratch,
            launch,
            scale,
            window,
        )
        return out

    def copy_blocks(self, pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        triton_cache_ops.copy_blocks(pool, src, dst)

    def swap_blocks(
        self, src_pool: torch.Tensor, dst_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        triton_cache_ops.swap_blocks(src_pool, dst_pool, src, dst)

    def _sm_count(self, device: torch.device) -> int:
        if device.type != "cuda":
            return 0  # the interpreter runs programs one by one: splitting only adds work
        if device not in self._num_sms:
            props = torch.cuda.get_device_properties(device)
            self._num_sms[device] = props.multi_processor_count
        return self._num_sms[device]


def _check_host_copies(meta: AttentionMetadata) -> None:
    """On the CPU the device tensors can be compared with the host lists at no cost."""
    lens = torch.tensor(meta.query_lens_host, dtype=torch.int64)
    starts = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    if not torch.equal(meta.query_start_loc.to(torch.int64), starts):
        raise ValueError("query_start_loc disagrees with query_lens_host")
    if meta.seq_lens.tolist() != meta.seq_lens_host:
        raise ValueError("seq_lens disagrees with seq_lens_host")


def _check_attention_inputs(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [N, bs, Hkv, D]
    value_cache: torch.Tensor,  # [N, bs, Hkv, D]
    plan: TritonAttentionPlan,
) -> None:
    meta = plan.meta
    check_cache(key_cache, "key_cache")
    check_cache(value_cache, "value_cache")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache {tuple(value_cache.shape)} != key_cache shape")
    if value_cache.stride() != key_cache.stride():
        # The kernel addresses both through one offset vector (as slices of one pool they agree).
        raise ValueError(
            f"value_cache strides {value_cache.stride()} != key_cache's {key_cache.stride()}"
        )
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"query must be [tokens, q_heads, {head_dim}], got {tuple(query.shape)}")
    if query.stride(2) != 1:
        raise ValueError("query must be contiguous in head_dim")
    if query.shape[0] != meta.num_tokens:
        raise ValueError(f"query has {query.shape[0]} tokens, the batch {meta.num_tokens}")
    if query.shape[1] % kv_heads:
        raise ValueError(f"q_heads ({query.shape[1]}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim must be a power of two in 16..256, got {head_dim}")
    if block_size != meta.block_size or block_size & (block_size - 1):
        raise ValueError(
            f"cache block size {block_size} must be a power of two equal to {meta.block_size}"
        )
    dtypes = {query.dtype, key_cache.dtype, value_cache.dtype}
    if len(dtypes) != 1 or query.dtype not in CACHE_DTYPES:
        raise ValueError(f"query and caches must share one of {CACHE_DTYPES}, got {dtypes}")
    devices = {query.device, key_cache.device, value_cache.device, plan.block_tables.device}
    if len(devices) != 1:
        raise ValueError(f"query, caches and metadata are on different devices: {devices}")
    if meta.max_seq_len > plan.block_tables.shape[1] * block_size:
        raise ValueError("a seq_len exceeds its block table's capacity")
    tables = plan.block_tables
    if tables.device.type == "cpu" and tables.numel():
        lo, hi = int(tables.min()), int(tables.max())
        if lo < 0 or hi >= num_blocks:
            raise ValueError(f"block_tables hold ids {lo}..{hi}, outside 0..{num_blocks - 1}")
