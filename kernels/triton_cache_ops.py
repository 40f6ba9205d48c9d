# mypy: allow-incomplete-defs
# (the @triton.jit kernels annotate only their tl.constexpr parameters)
"""KV cache ops in Triton: write new tokens into their slots, copy blocks, swap blocks.

Pools are `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`; one block of one layer's
K (or V) is `block_size * kv_heads * head_dim` contiguous elements, so every block op is a
batch of flat row copies: one program per (block pair, layer x K/V, chunk of the block), one
launch per batch of blocks.

The host wrappers here check what they are given (shapes, strides, dtypes, devices; index
values when that costs no device-to-host sync) and raise ValueError on anything wrong; the
kernels then index memory without bounds checks.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "on", "yes"}
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Elements one program copies: 16 KiB of bf16, enough to keep a program busy for a while.
COPY_CHUNK = 8192


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    key_cache_ptr,  # [N, bs, Hkv, D]
    value_cache_ptr,  # [N, bs, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    row_numel,  # kv_heads x head_dim
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # elements of the row one program moves, a power of two
    PAGE_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    elems = chunk * ROW + tl.arange(0, ROW)
    head = elems // HEAD_DIM
    dim = elems % HEAD_DIM
    mask = elems < row_numel
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim, mask=mask)
    k_dst = key_cache_ptr + block * stride_kcb + offset * stride_kco + head * stride_kch + dim
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vco + head * stride_vch + dim
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


@triton.jit
def _copy_blocks_kernel(
    src_ptr,  # [L, 2, Ns, bs, Hkv, D] (any strides above the block)
    dst_ptr,  # [L, 2, Nd, bs, Hkv, D]
    src_ids_ptr,  # [K] int64 (unused without HAS_SRC_IDS: block k is src block k)
    dst_ids_ptr,  # [K] int64 (likewise)
    src_stride_l,
    src_stride_kv,
    src_stride_n,
    dst_stride_l,
    dst_stride_kv,
    dst_stride_n,
    block_numel,
    HAS_SRC_IDS: tl.constexpr,
    HAS_DST_IDS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    layer = (tl.program_id(1) // 2).to(tl.int64)
    kv = (tl.program_id(1) % 2).to(tl.int64)
    chunk = tl.program_id(2)
    src_block = pair.to(tl.int64)
    if HAS_SRC_IDS:
        src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_block = pair.to(tl.int64)
    if HAS_DST_IDS:
        dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
    elems = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = elems < block_numel
    src = src_ptr + layer * src_stride_l + kv * src_stride_kv + src_block * src_stride_n
    dst = dst_ptr + layer * dst_stride_l + kv * dst_stride_kv + dst_block * dst_stride_n
    tl.store(dst + elems, tl.load(src + elems, mask=mask), mask=mask)


def kernels_run_on(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and INTERPRETER)


def check_cache(cache: torch.Tensor, name: str) -> None:
    """A per-layer cache `[N, bs, Hkv, D]` with each token's row contiguous."""
    if cache.dim() != 4:
        raise ValueError(f"{name} must be [num_blocks, block_size, kv_heads, head_dim]")
    if cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"{name} dtype {cache.dtype} is not one of {CACHE_DTYPES}")
    if cache.stride(3) != 1:
        raise ValueError(f"{name} must be contiguous in head_dim (stride {cache.stride(3)})")


def check_pool(pool: torch.Tensor, name: str) -> None:
    """A pool `[L, 2, N, bs, Hkv, D]` whose blocks are each one contiguous run."""
    if pool.dim() != 6 or pool.shape[1] != 2:
        raise ValueError(f"{name} must be [layers, 2, num_blocks, block_size, kv_heads, head_dim]")
    if pool.dtype not in CACHE_DTYPES:
        raise ValueError(f"{name} dtype {pool.dtype} is not one of {CACHE_DTYPES}")
    heads, dim = pool.shape[4], pool.shape[5]
    if (pool.stride(3), pool.stride(4), pool.stride(5)) != (heads * dim, dim, 1):
        raise ValueError(f"{name} blocks must be contiguous (strides {pool.stride()})")


def check_ids(ids: torch.Tensor, name: str, num_blocks: int) -> None:
    """A 1-D integer id tensor; its values are checked when that needs no device sync."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {ids.dtype} {ids.shape}")
    if ids.device.type == "cpu" and ids.numel() > 0:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_blocks:
            raise ValueError(f"{name} holds block ids {lo}..{hi}, outside 0..{num_blocks - 1}")


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [N, bs, Hkv, D]
    value_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Scatter each new token's K and V into its cache slot."""
    check_cache(key_cache, "key_cache")
    check_cache(value_cache, "value_cache")
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError("key_cache and value_cache differ in shape or dtype")
    num_blocks, block_size, heads, dim = key_cache.shape
    for t, name in ((key, "key"), (value, "value")):
        if t.dim() != 3 or t.shape[1:] != (heads, dim):
            raise ValueError(f"{name} must be [tokens, {heads}, {dim}], got {tuple(t.shape)}")
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
        if t.dtype not in CACHE_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is not one of {CACHE_DTYPES}")
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"key, value and slot_mapping must all have {num_tokens} tokens")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    _check_same_device((key, value, key_cache, value_cache, slot_mapping))
    if slot_mapping.device.type == "cpu" and num_tokens > 0:
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < 0 or hi >= num_blocks * block_size:
            raise ValueError(
                f"slot_mapping holds {lo}..{hi}, outside 0..{num_blocks * block_size - 1}"
            )
    if num_tokens == 0:
        return
    # Casts go through torch, which rounds to nearest even everywhere (Triton's interpreter
    # truncates fp32 -> bf16); the model normally projects in the cache's dtype already.
    key, value = key.to(key_cache.dtype), value.to(key_cache.dtype)
    row = min(triton.next_power_of_2(heads * dim), 4096)
    grid = (num_tokens, triton.cdiv(heads * dim, row))
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        heads * dim,
        HEAD_DIM=dim,
        ROW=row,
        PAGE_SIZE=block_size,
        num_warps=4,
    )


def copy_blocks(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks (every layer, K and V) inside one pool: copy-on-write.

    NOTE: all blocks are copied at once, so a dst id must not also be a src id (the reference
    gathers before it scatters; here that would race). The block manager hands out fresh
    blocks as copy-on-write targets, which never are sources.
    """
    check_pool(pool, "pool")
    num_blocks = pool.shape[2]
    check_ids(src, "src", num_blocks)
    check_ids(dst, "dst", num_blocks)
    if src.shape != dst.shape:
        raise ValueError(f"src and dst differ in length ({src.shape[0]} vs {dst.shape[0]})")
    if src.device.type == "cpu" and dst.device.type == "cpu" and src.numel():
        if torch.unique(dst).numel() != dst.numel():
            raise ValueError("dst block ids must be distinct")
        if torch.isin(dst, src).any():
            raise ValueError("a dst block id is also a src block id")
    if src.numel() == 0:
        return
    src, dst = _ids_on(src, pool.device), _ids_on(dst, pool.device)
    if not kernels_run_on(pool.device):
        pool[:, :, dst] = pool[:, :, src]
        return
    _launch_copy(pool, pool, src, dst, src.numel())


def gather_blocks(
    pool: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Blocks `ids` of every layer, K and V, as one contiguous `[L, 2, K, bs, Hkv, D]` tensor."""
    check_pool(pool, "pool")
    check_ids(ids, "ids", pool.shape[2])
    layers, _, _, bs, heads, dim = pool.shape
    shape = (layers, 2, ids.numel(), bs, heads, dim)
    if out is None:
        out = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    elif out.shape != shape or not out.is_contiguous() or out.dtype != pool.dtype:
        raise ValueError(f"out must be a contiguous {pool.dtype} tensor of shape {shape}")
    if out.device != pool.device:
        raise ValueError(f"out is on {out.device}, pool on {pool.device}")
    if ids.numel() == 0:
        return out
    ids = _ids_on(ids, pool.device)
    if kernels_run_on(pool.device):
        _launch_copy(pool, out, ids, None, ids.numel())
        return out
    try:
        # As rows [L * 2, N, block numel]: many times faster than indexing the 6-d tensor
        # (measured on the CPU, where a 6-d bf16 index_select ran at 0.15 GB/s).
        rows = pool.view(layers * 2, pool.shape[2], -1)
    except RuntimeError:  # a pool whose (layer, K/V) dims cannot merge
        torch.index_select(pool, 2, ids, out=out)
    else:
        torch.index_select(rows, 1, ids, out=out.view(layers * 2, ids.numel(), -1))
    return out


def scatter_blocks(staged: torch.Tensor, pool: torch.Tensor, ids: torch.Tensor) -> None:
    """Write staged blocks `[L, 2, K, bs, Hkv, D]` into `pool` at block ids `ids`."""
    check_pool(pool, "pool")
    check_ids(ids, "ids", pool.shape[2])
    layers, _, _, bs, heads, dim = pool.shape
    shape = (layers, 2, ids.numel(), bs, heads, dim)
    if staged.shape != shape or staged.dtype != pool.dtype or not staged.is_contiguous():
        raise ValueError(f"staged must be a contiguous {pool.dtype} tensor of shape {shape}")
    if staged.device != pool.device:
        raise ValueError(f"staged is on {staged.device}, pool on {pool.device}")
    if ids.device.type == "cpu" and torch.unique(ids).numel() != ids.numel():
        raise ValueError("destination block ids must be distinct")
    if ids.numel() == 0:
        return
    ids = _ids_on(ids, pool.device)
    if kernels_run_on(pool.device):
        _launch_copy(staged, pool, None, ids, ids.numel())
    else:
        pool[:, :, ids] = staged


def swap_blocks(
    src_pool: torch.Tensor, dst_pool: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """Move whole blocks between pools (device <-> CPU): gather, one bulk copy, scatter.

    The gather runs on the source's device into one contiguous staging buffer (pinned when
    it is on the CPU and the other side is CUDA), which crosses devices in one copy.
    NOTE: a copy towards the CPU is waited for (a CUDA event) before the CPU reads it.
    """
    check_pool(src_pool, "src_pool")
    check_pool(dst_pool, "dst_pool")
    if src_pool.dtype != dst_pool.dtype:
        raise ValueError(f"pools differ in dtype ({src_pool.dtype} vs {dst_pool.dtype})")
    if src_pool.shape[:2] != dst_pool.shape[:2] or src_pool.shape[3:] != dst_pool.shape[3:]:
        raise ValueError(
            f"pools differ in layout ({tuple(src_pool.shape)} vs {tuple(dst_pool.shape)})"
        )
    if src_ids.shape != dst_ids.shape:
        raise ValueError(
            f"src_ids and dst_ids differ in length ({src_ids.shape} vs {dst_ids.shape})"
        )
    if src_ids.numel() == 0:
        check_ids(src_ids, "src_ids", src_pool.shape[2])
        check_ids(dst_ids, "dst_ids", dst_pool.shape[2])
        return
    src_dev, dst_dev = src_pool.device, dst_pool.device
    staging = None
    if src_dev.type == "cpu" and dst_dev.type == "cuda":
        layers, _, _, bs, heads, dim = src_pool.shape
        shape = (layers, 2, src_ids.numel(), bs, heads, dim)
        staging = torch.empty(shape, dtype=src_pool.dtype, pin_memory=True)
    staged = gather_blocks(src_pool, src_ids, out=staging)
    if src_dev != dst_dev:
        staged = _to_device(staged, dst_dev)
    scatter_blocks(staged, dst_pool, dst_ids)


def _to_device(staged: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu" and staged.device.type == "cuda":
        host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
        host.copy_(staged, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return host
    # Towards a GPU the copy is ordered before the scatter on the destination's stream.
    return staged.to(device, non_blocking=True)


def _launch_copy(
    src: torch.Tensor,  # [L, 2, Ns, bs, Hkv, D]
    dst: torch.Tensor,  # [L, 2, Nd, bs, Hkv, D]
    src_ids: torch.Tensor | None,  # [K]
    dst_ids: torch.Tensor | None,  # [K]
    num_pairs: int,
) -> None:
    layers, _, _, bs, heads, dim = src.shape
    block_numel = bs * heads * dim
    chunk = min(COPY_CHUNK, triton.next_power_of_2(block_numel))
    grid = (num_pairs, layers * 2, triton.cdiv(block_numel, chunk))
    # An unused id pointer still needs a tensor argument; the kernel never reads it.
    ids_or = src_ids if src_ids is not None else dst_ids
    _copy_blocks_kernel[grid](
        src,
        dst,
        src_ids if src_ids is not None else ids_or,
        dst_ids if dst_ids is not None else ids_or,
        src.stride(0),
        src.stride(1),
        src.stride(2),
        dst.stride(0),
        dst.stride(1),
        dst.stride(2),
        block_numel,
        HAS_SRC_IDS=src_ids is not None,
        HAS_DST_IDS=dst_ids is not None,
        CHUNK=chunk,
        num_warps=4,
    )


def _ids_on(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Host-to-GPU copies may run async (the source is staged before `to` returns); a copy to
    # the CPU must finish before the CPU indexes with it.
    return ids.to(device, non_blocking=device.type == "cuda")


def _check_same_device(tensors: tuple[torch.Tensor, ...]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors are on different devices: {sorted(map(str, devices))}")
