"""Pure-torch paged attention and cache ops: the CPU backend and the Triton kernels' oracle.

Attention is planned once per step (gather indices and masks shared by every layer; layers that
slide a window share a second plan), then each layer gathers its K/V through the plan and calls
torch's SDPA. Decode rows (one query token) are
batched into a single padded SDPA call; prefill chunks, few per step, run one SDPA each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


@dataclass(slots=True)
class DecodeGroup:
    rows: torch.Tensor  # [Bd] int64: query rows (one per sequence)
    blocks: torch.Tensor  # [Bd, C] int64: physical block of each context position (0 = pad)
    offsets: torch.Tensor  # [Bd, C] int64: offset inside that block
    slots: torch.Tensor  # [Bd * C] int64: blocks * block_size + offsets, flattened
    mask: torch.Tensor  # [Bd, 1, 1, C] bool: True where the position is a key the row sees
    seq_lens: torch.Tensor  # [Bd] int64: how many keys each row sees (its leading valid slots)


@dataclass(slots=True)
class PrefillChunk:
    query_start: int
    query_len: int
    blocks: torch.Tensor  # [S] int64
    offsets: torch.Tensor  # [S] int64
    slots: torch.Tensor  # [S] int64
    # [Q, S] bool: causal with the cached prefix, inside the window; None: plain causal
    mask: torch.Tensor | None


@dataclass(slots=True)
class TorchAttentionPlan:
    num_tokens: int
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]
    meta: AttentionMetadata
    window: int | None = None  # keys each query sees, itself included; None: all before it
    # Plans of the same step for other windows, made at their first layer and kept for the rest.
    others: dict[int | None, TorchAttentionPlan] = field(default_factory=dict)

    def windowed(self, window: int | None) -> TorchAttentionPlan:
        """This step's plan for layers that see only the last `window` keys."""
        if window == self.window:
            return self
        if window not in self.others:
            self.others[window] = plan_attention(self.meta, window)
        return self.others[window]


def plan_attention(meta: AttentionMetadata, window: int | None = None) -> TorchAttentionPlan:
    """Precompute gather indices and masks for one step (no device-to-host sync). With a
    `window`, each query sees only the `window` keys ending at its own position, and only
    those are gathered."""
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    device = meta.block_tables.device
    bs = meta.block_size
    tables = meta.block_tables.to(torch.int64)
    starts = _prefix_sums(meta.query_lens_host)
    decode_idx = [i for i, q in enumerate(meta.query_lens_host) if q == 1]
    decode: DecodeGroup | None = None
    if decode_idx:
        firsts = [_first_key(meta.seq_lens_host[i], 1, window) for i in decode_idx]
        counts = [meta.seq_lens_host[i] - f for i, f in zip(decode_idx, firsts, strict=True)]
        idx = torch.tensor(decode_idx, dtype=torch.int64, device=device)
        seen = torch.tensor(counts, dtype=torch.int64, device=device)  # keys each row sees
        first = torch.tensor(firsts, dtype=torch.int64, device=device)
        column = torch.arange(max(counts), device=device)  # [C]
        valid = column[None, :] < seen[:, None]  # [Bd, C]
        # Padding reads the row's own first key, never stale slots that may hold NaN.
        pos = first[:, None] + torch.where(valid, column[None, :], 0)  # [Bd, C]
        blocks = torch.gather(tables[idx], 1, pos // bs)
        offsets = pos % bs
        decode = DecodeGroup(
            rows=torch.tensor([starts[i] for i in decode_idx], dtype=torch.int64, device=device),
            blocks=blocks,
            offsets=offsets,
            slots=(blocks * bs + offsets).flatten(),
            mask=valid[:, None, None, :],
            seq_lens=seen,
        )
    prefills: list[PrefillChunk] = []
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        if q_len == 1:
            continue
        first_key = _first_key(s_len, q_len, window)
        pos = torch.arange(first_key, s_len, device=device)
        mask = None
        if q_len != s_len or (window is not None and window < s_len):
            q_pos = torch.arange(s_len - q_len, s_len, device=device)
            mask = pos[None, :] <= q_pos[:, None]  # [Q, S]
            if window is not None:
                mask &= pos[None, :] > q_pos[:, None] - window
        blocks = tables[i, pos // bs]
        prefills.append(
            PrefillChunk(
                query_start=starts[i],
                query_len=q_len,
                blocks=blocks,
                offsets=pos % bs,
                slots=blocks * bs + pos % bs,
                mask=mask,
            )
        )
    return TorchAttentionPlan(
        num_tokens=meta.num_tokens, decode=decode, prefills=prefills, meta=meta, window=window
    )


def _first_key(seq_len: int, query_len: int, window: int | None) -> int:
    """The first context position any of a chunk's queries (the last `query_len` of
    `seq_len`) sees through a window."""
    if window is None:
        return 0
    return max(0, seq_len - query_len - window + 1)


DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, DecodeGroup, float], torch.Tensor
]


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [N, bs, Hkv, D]
    value_cache: torch.Tensor,  # [N, bs, Hkv, D]
    plan: TorchAttentionPlan,
    scale: float,
    decode: DecodeAttention | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Attention of each sequence's new tokens over its paged context (written beforehand).
    `decode` computes the decode rows (default: one padded SDPA over gathered K/V; the CPU
    backend passes a kernel that reads the cache in place)."""
    decode = decode or decode_sdpa
    if plan.decode is not None and not plan.prefills:
        # Every row decodes, in order: no rows to pick out or put back.
        return decode(query, key_cache, value_cache, plan.decode, scale)
    out = torch.empty_like(query)
    if plan.decode is not None:
        g = plan.decode
        out[g.rows] = decode(query[g.rows], key_cache, value_cache, g, scale)
    gqa = query.shape[1] != key_cache.shape[2]
    for p in plan.prefills:
        rows = slice(p.query_start, p.query_start + p.query_len)
        # With a batch dimension: torch's CPU flash kernel takes 4-d inputs only, and 3-d
        # ones fell back to the math path (2x slower at 106 tokens, 9 heads).
        q = query[rows].transpose(0, 1)[None]  # [1, Hq, Q, D]
        # [1, Hkv, S, D], in the query's dtype (a 16-bit cache under fp32 activations)
        k = _gather(key_cache, p.blocks, p.offsets, p.slots).to(q.dtype).transpose(0, 1)[None]
        v = _gather(value_cache, p.blocks, p.offsets, p.slots).to(q.dtype).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=gqa
        )
        out[rows] = o[0].transpose(0, 1)
    return out


def decode_sdpa(
    query: torch.Tensor,  # [Bd, Hq, D]: one row per decoding sequence
    key_cache: torch.Tensor,  # [N, bs, Hkv, D]
    value_cache: torch.Tensor,  # [N, bs, Hkv, D]
    g: DecodeGroup,
    scale: float,
) -> torch.Tensor:  # [Bd, Hq, D]
    """One padded SDPA call for all decode rows."""
    gqa = query.shape[1] != key_cache.shape[2]
    q = query.unsqueeze(2)  # [Bd, Hq, 1, D]
    # [Bd, Hkv, C, D], in the query's dtype (a 16-bit cache under fp32 activations)
    k = _gather(key_cache, g.blocks, g.offsets, g.slots).to(q.dtype).transpose(1, 2)
    v = _gather(value_cache, g.blocks, g.offsets, g.slots).to(q.dtype).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale, enable_gqa=gqa)
    return o.squeeze(2)


def _gather(
    cache: torch.Tensor,  # [N, bs, Hkv, D]
    blocks: torch.Tensor,  # [...] int64
    offsets: torch.Tensor,  # [...] int64
    slots: torch.Tensor,  # [prod(...)] int64
) -> torch.Tensor:  # [..., Hkv, D]
    """K or V of the given positions. A contiguous cache is one flat index_select over slots,
    faster on the CPU than indexing blocks and offsets separately (docs/perf-history.md,
    "Engine: `benchmarks/engine_step.py` with dense dtypes")."""
    if not cache.is_contiguous():
        return cache[blocks, offsets]
    flat = cache.view(-1, cache.shape[2], cache.shape[3])  # [N * bs, Hkv, D]
    return flat.index_select(0, slots).view(*blocks.shape, cache.shape[2], cache.shape[3])


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [N, bs, Hkv, D]
    value_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    for new, cache in ((key, key_cache), (value, value_cache)):
        if cache.is_contiguous():  # one flat scatter over slots, no block/offset split
            flat = cache.view(-1, cache.shape[2], cache.shape[3])  # [N * bs, Hkv, D]
            flat.index_copy_(0, slot_mapping, new.to(cache.dtype))
        else:
            bs = cache.shape[1]
            cache[slot_mapping // bs, slot_mapping % bs] = new.to(cache.dtype)


def copy_blocks(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks (every layer, K and V) within one pool: copy-on-write.

    pool: [L, 2, N, bs, Hkv, D]; src, dst: [K] int64 with distinct dst ids.
    """
    pool[:, :, dst] = pool[:, :, src]


def swap_blocks(
    src_pool: torch.Tensor, dst_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Move whole blocks between pools (device <-> CPU): gather, one copy, scatter."""
    staged = src_pool[:, :, src.to(src_pool.device)]
    # Only host-to-device may be asynchronous: a device-to-host copy is read right away.
    to_device = staged.to(dst_pool.device, non_blocking=dst_pool.device.type == "cuda")
    dst_pool[:, :, dst.to(dst_pool.device)] = to_device


def _prefix_sums(lengths: list[int]) -> list[int]:
    starts, acc = [], 0
    for n in lengths:
        starts.append(acc)
        acc += n
    return starts
