# mypy: allow-incomplete-defs
# (the @triton.jit kernels annotate only their tl.constexpr parameters)
"""Unified paged attention for a mixed batch (prefill chunks and decode tokens) in Triton.

One launch covers the whole batch, semantics as `kernels.reference.paged_attention`: sequence i
owns query rows [qsl[i], qsl[i+1]) at the end of its `seq_len` tokens of context, and each row
attends to the context positions up to its own through the block table (with a sliding window,
only the last `window` of them: the program's context range starts at its first row's
window).

Grid `(q_blocks, kv_heads, splits)`. A program takes BLOCK_Q consecutive query tokens of one
sequence and every query head of one KV head, flattened into BLOCK_M = BLOCK_Q * GROUP rows
(row r: token r // GROUP, head r % GROUP), so each K/V tile is loaded once per KV head and
serves the whole GQA group; BLOCK_M is at least 16 because `tl.dot` needs M >= 16 on GPUs. It
walks the context in TILE_N-token tiles, looking up each token's physical block, with an
online softmax in fp32 (exp2, the scale folded with log2(e)). Tiles that every row of the
program sees in full (all of a decode token's context but its last partial tile; a prefill
chunk's cached prefix) run without bounds or causal masks; only the causal diagonal and the
tail pay for them.

Split-KV (flash-decoding): when the batch alone gives too few programs to fill the GPU (small
decode batches over long contexts), each tile's context is cut into NUM_SPLITS equal ranges,
one program each; they write unnormalised partial results (acc, running max m, sum l) to a
scratch buffer and `_reduce_splits_kernel` merges them. Every program of a live q-block
writes all its splits, empty ones included (m = -inf, l = 0, acc = 0), so the reduce needs no
knowledge of the sequences.

Q-block to sequence: sequence i owns q-blocks [qsl[i] // BLOCK_Q + i, ... + cdiv(q_len,
BLOCK_Q)); a program finds its sequence by binary search over query_start_loc, so the grid
needs only host-known totals (`num_tokens // BLOCK_Q + num_seqs` programs bound them) and
nothing is copied to the device per step. Decode-only batches (one token per sequence) map
program i to sequence i directly.

The tiling, grid and split count come from `kernels.attention_launch`. These launchers trust
their inputs: `kernels.triton_backend.TritonBackend` validates shapes, dtypes, devices and
block ids before calling them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.attention_launch import AttentionLaunch, offsets_fit_int32

# Read the way Triton reads it when the @triton.jit decorators below run.
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "on", "yes"}
LOG2_E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest i with qsl[i] // BLOCK_Q + i <= q_block (sequence i owns that q-block)."""
    # Annotated so both stay int32 loop-carried values even when num_seqs is specialised to 1.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 accumulating dot; fp32 inputs in true fp32 (a GPU would default to TF32).

    UPCAST: the interpreter multiplies bf16 operands as their raw uint16 bits (Triton 3.9
    `create_dot`), so under it 16-bit operands go through fp32 instead, same values.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_tile(
    acc,  # [M, D] fp32
    l_i,  # [M] fp32
    m_i,  # [M] fp32, log2 domain
    q,  # [M, D]
    pos,  # [M] context position of each row's token
    start,  # first context position of the tile
    hi,  # end of this program's context range
    window,  # keys a row sees, its own included (WINDOWED only)
    table,  # the sequence's block-table row
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    scale_log2,
    stride_cb,
    stride_co,
    stride_ch,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    WINDOWED: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One TILE_N-token step of the online softmax. MASKED: the tile may run past `hi` or
    hold positions some rows must not see (after a row's own, or, WINDOWED, `window` or more
    before it); without it every load and score is used as is.

    K and V are both loaded [N, D] through one offset vector (the caches share strides), so
    the block ids are loaded and turned into addresses once; OFFSETS_32 keeps that arithmetic
    in int32 when the host knows every offset fits. Together they cut the loop body's
    instructions by about a third on sm_90 (SASS of Triton 3.6), see docs/perf-history.md.
    """
    dims = tl.arange(0, HEAD_DIM)
    kpos = start + tl.arange(0, TILE_N)  # [N]
    if MASKED:
        kmask = kpos < hi
        blk = tl.load(table + kpos // PAGE_SIZE, mask=kmask, other=0)  # [N]
    else:
        blk = tl.load(table + kpos // PAGE_SIZE)  # [N]
    if not OFFSETS_32:
        blk = blk.to(tl.int64)
    kv_off = blk * stride_cb + (kpos % PAGE_SIZE) * stride_co + kv_head * stride_ch  # [N]
    k_ptrs = k_cache_ptr + kv_off[:, None] + dims[None, :]  # [N, D]
    v_ptrs = v_cache_ptr + kv_off[:, None] + dims[None, :]  # [N, D]
    if MASKED:
        k = tl.load(k_ptrs, mask=kmask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=kmask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = _dot(q, tl.trans(k), IEEE_DOT, UPCAST_DOT) * scale_log2  # [M, N], log2 domain
    if MASKED:
        allowed = kmask[None, :] & (kpos[None, :] <= pos[:, None])
        if WINDOWED:
            allowed = allowed & (kpos[None, :] > pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing allowed yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])  # [M, N]
    alpha = tl.exp2(m_i - m_safe)  # [M]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_DOT, UPCAST_DOT)
    return acc, l_i, m_new


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [N, bs, Hkv, D]
    v_cache_ptr,  # [N, bs, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    part_out_ptr,  # [T, Hq, S, D] fp32 (split-KV only)
    part_m_ptr,  # [T, Hq, S] fp32
    part_l_ptr,  # [T, Hq, S] fp32
    scale_log2,
    window,  # keys each row sees, its own included (WINDOWED only)
    num_seqs,
    num_q_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,  # the caches' strides (K and V share them)
    stride_co,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ONE_TOKEN_PER_SEQ: tl.constexpr,
    SKIP_MASKS: tl.constexpr,
    WINDOWED: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if ONE_TOKEN_PER_SEQ:
        seq = q_block
        local_block = 0
    else:
        seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
        local_block = q_block - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    # The grid over-counts q-blocks by at most one per sequence; the spare programs stop here.
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = local_block * BLOCK_Q + rows // GROUP  # [M] token index inside the chunk
    head = kv_head * GROUP + rows % GROUP  # [M]
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)  # [M]
    pos = ctx_len + tok  # [M] context position of each row's token
    dims = tl.arange(0, HEAD_DIM)
    t_glob = (q_start + tok).to(tl.int64)  # [M]
    q = tl.load(
        q_ptr + t_glob[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )  # [M, D]

    # The tile's last token sees the most context; rows before it are masked causally. Under
    # a window the first token's reaches back furthest; rows after it are masked there.
    kv_end = tl.minimum(seq_len, ctx_len + (local_block + 1) * BLOCK_Q)
    first_pos = ctx_len + local_block * BLOCK_Q
    kv_start = tl.maximum(first_pos - window + 1, 0) if WINDOWED else 0
    if NUM_SPLITS == 1:
        lo = kv_start
        hi = kv_end
    else:
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), TILE_N) * TILE_N
        lo = kv_start + split * per_split
        hi = tl.minimum(lo + per_split, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Whole tiles at or before the first row's position (and, under a window, inside the
    # last row's) are seen by every row and lie inside the context: they skip the bounds and
    # causal masks (a decode token's whole context but its last partial tile). The rest, the
    # window's edge, the causal diagonal and the tail, is masked.
    if SKIP_MASKS:
        if WINDOWED:
            seen_from = tl.maximum(kv_end - window, lo)
            head_end = lo + tl.cdiv(seen_from - lo, TILE_N) * TILE_N
        else:
            head_end = lo
        seen_by_all = tl.minimum(hi, first_pos + 1)
        unmasked_end = head_end + tl.maximum(seen_by_all - head_end, 0) // TILE_N * TILE_N
    else:
        head_end = lo
        unmasked_end = lo
    if WINDOWED:
        for start in range(lo, tl.minimum(head_end, hi), TILE_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, pos, start, hi, window, table, k_cache_ptr, v_cache_ptr,
                kv_head, scale_log2, stride_cb, stride_co, stride_ch,
                TILE_N, HEAD_DIM, PAGE_SIZE, True, True, OFFSETS_32, IEEE_DOT, UPCAST_DOT,
            )  # fmt: skip
    for start in range(head_end, unmasked_end, TILE_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, pos, start, hi, window, table, k_cache_ptr, v_cache_ptr,
            kv_head, scale_log2, stride_cb, stride_co, stride_ch,
            TILE_N, HEAD_DIM, PAGE_SIZE, False, WINDOWED, OFFSETS_32, IEEE_DOT, UPCAST_DOT,
        )  # fmt: skip
    for start in range(unmasked_end, hi, TILE_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, pos, start, hi, window, table, k_cache_ptr, v_cache_ptr,
            kv_head, scale_log2, stride_cb, stride_co, stride_ch,
            TILE_N, HEAD_DIM, PAGE_SIZE, True, WINDOWED, OFFSETS_32, IEEE_DOT, UPCAST_DOT,
        )  # fmt: skip

    if NUM_SPLITS == 1:
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + t_glob[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
    else:
        part = (t_glob * num_q_heads + head) * NUM_SPLITS + split  # [M]
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [T, Hq, D]
    part_out_ptr,  # [T, Hq, S, D] fp32
    part_m_ptr,  # [T, Hq, S] fp32
    part_l_ptr,  # [T, Hq, S] fp32
    num_q_heads,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * num_q_heads + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    m = tl.load(part_m_ptr + base + splits)  # [S]
    lsum = tl.load(part_l_ptr + base + splits)  # [S]
    acc = tl.load(part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :])  # [S, D]
    # Every row sees its own position, which some split holds, so m_max is finite.
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # [S]; empty splits (m = -inf) weigh 0
    total = tl.sum(w * lsum, 0)
    out = tl.sum(w[:, None] * acc, 0) / total  # [D]
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty)
    )


def launch_paged_attention(
    out: torch.Tensor,  # [T, Hq, D]
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [N, bs, Hkv, D]
    value_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    launch: AttentionLaunch,
    scale: float,
    window: int | None = None,
) -> None:
    """Launch attention (and the split reduce); inputs already validated by the caller, the
    value cache with the key cache's strides. `window`: each row sees only that many keys,
    its own included."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    part_out, part_m, part_l = scratch
    grid = (launch.num_q_blocks, num_kv_heads, launch.num_splits)
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        part_out,
        part_m,
        part_l,
        scale * LOG2_E,
        window or 0,
        seq_lens.shape[0],
        num_q_heads,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        GROUP=launch.group,
        BLOCK_M=launch.block_m,
        BLOCK_Q=launch.block_q,
        TILE_N=launch.tile_n,
        HEAD_DIM=head_dim,
        PAGE_SIZE=key_cache.shape[1],
        NUM_SPLITS=launch.num_splits,
        ONE_TOKEN_PER_SEQ=launch.one_token_per_seq,
        SKIP_MASKS=launch.skip_masks,
        WINDOWED=window is not None,
        OFFSETS_32=launch.narrow_offsets and offsets_fit_int32(key_cache),
        IEEE_DOT=query.dtype == torch.float32,
        UPCAST_DOT=INTERPRETER and query.dtype == torch.bfloat16,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **({} if launch.max_registers is None else {"maxnreg": launch.max_registers}),
    )
    if launch.num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_q_heads)](
            out,
            part_out,
            part_m,
            part_l,
            num_q_heads,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=launch.num_splits,
            HEAD_DIM=head_dim,
            num_warps=4,
        )
