"""Typed wrappers of the CPU kernels, over torch tensors: each checks shapes, dtypes and layout,
then calls the version a `KernelSet` chose (kernels/cpu/dispatch.py).

Every wrapper runs on the calling thread, except `gemv_threads`, which may split its rows with
the library's helper threads.

NOTE: nothing here splits work across threads of torch's: with two torch threads, torch's
OpenMP worker spins for a while after each op, and a thread of ours for the other half
fought it for the second core (docs/perf-history.md, "Packed weights (`--weights auto | int4 |
int8`), 2026-12-02, AVX512 EPYC (before the stack)").
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kernels.cpu.formats import Blocks
from kernels.cpu.structs import MAX_PARTS, CAttention, CProjection

if TYPE_CHECKING:
    from kernels.cpu.dispatch import KernelSet

# Element types of caches and dense outputs, as pagechat_cpu.h numbers them.
ELEMENT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_HEAD_DIM = 512

_OK, _NO_MEMORY, _BAD_SHAPE = 0, 1, 2


def projection(parts: Sequence[Blocks]) -> CProjection:
    """Weights of one k whose outputs follow one another, as the C side reads them. The
    caller keeps the parts' tensors alive while it is in use."""
    if not 1 <= len(parts) <= MAX_PARTS or len({p.k for p in parts}) != 1:
        raise ValueError(f"a projection is 1 to {MAX_PARTS} weights of one k")
    out = CProjection(parts=len(parts), n=sum(p.n for p in parts), k=parts[0].k)
    for slot, p in zip(out.part, parts, strict=False):
        slot.type, slot.n, slot.k = p.code, p.n, p.k
        slot.row_bytes, slot.data = p.data.shape[1], p.data.data_ptr()
    return out


def _check(t: Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], name: str) -> None:
    if tuple(t.shape) != shape or t.dtype not in dtypes:
        raise ValueError(f"{name} {tuple(t.shape)} {t.dtype}, want {shape} in {dtypes}")
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: the CPU kernels take contiguous CPU tensors")


def _input(x: Tensor, k: int) -> Tensor:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise ValueError(f"input {tuple(x.shape)} {x.dtype} for weights of k = {k}")
    return x.contiguous()


def gemv(kernels: KernelSet, weight: Blocks, x: Tensor) -> Tensor:
    """x [m, k] fp32 times a weight [n, k]: [m, n] fp32, each output an fp32 dot product of
    the input with the weight row as gguf dequantizes it."""
    x = _input(x, weight.k)
    y = torch.empty(x.shape[0], weight.n, dtype=torch.float32)
    status = kernels.fn("gemv")(
        weight.code, weight.data.data_ptr(), weight.data.shape[1], x.data_ptr(),
        x.shape[0], weight.k, y.data_ptr(), weight.n, 0, weight.n,
    )  # fmt: skip
    _raise_for(status, "gemv")
    return y


def gemv_q8(kernels: KernelSet, weight: Blocks, x: Tensor) -> Tensor:
    """`gemv` with the input taken as int8 per 32 elements (`quantize_q8`): [m, n] fp32."""
    x = _input(x, weight.k)
    y = torch.empty(x.shape[0], weight.n, dtype=torch.float32)
    status = kernels.fn("gemv_q8")(
        weight.code, weight.data.data_ptr(), weight.data.shape[1], x.data_ptr(),
        x.shape[0], weight.k, y.data_ptr(), weight.n, 0, weight.n,
    )  # fmt: skip
    _raise_for(status, "gemv_q8")
    return y


def q8_row_bytes(k: int) -> int:
    """Bytes of one int8 input row of k elements (pagechat_cpu.h, `pc_q8_row_bytes`)."""
    return k + k // 32 * 8 + k // 16 * 4


def quantize_q8(kernels: KernelSet, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [m, k] fp32 (k a multiple of 32) as the int8 products take it: q [m, k] int8, a
    scale per 32 [m, k / 32] (x ~ scale q), scale * sum(q) per 32 [m, k / 32] and per 16
    [m, k / 16]."""
    m, k = x.shape
    if k % 32:
        raise ValueError(f"int8 inputs come in blocks of 32, not {k}")
    x = _input(x, k)
    out = torch.empty(m, q8_row_bytes(k), dtype=torch.uint8)
    kernels.fn("quantize_q8")(x.data_ptr(), m, k, out.data_ptr())
    q = out[:, :k].view(torch.int8)
    scales = out[:, k : k + k // 8].contiguous().view(torch.float32)
    sums32 = out[:, k + k // 8 : k + k // 4].contiguous().view(torch.float32)
    sums16 = out[:, k + k // 4 :].contiguous().view(torch.float32)
    return q, scales, sums32, sums16


def gemv_threads(kernels: KernelSet, parts: Sequence[Blocks], x: Tensor, threads: int) -> Tensor:
    """`gemv` over weights whose outputs follow one another ([m, sum of n]), the rows split
    between up to `threads` threads (the caller's and the library's helpers, where they are
    free)."""
    weights = projection(parts)
    x = _input(x, weights.k)
    y = torch.empty(x.shape[0], weights.n, dtype=torch.float32)
    status = kernels.lib.pc_gemv_threads(
        ctypes.byref(kernels.table), ctypes.byref(weights), x.data_ptr(), x.shape[0],
        y.data_ptr(), threads,
    )  # fmt: skip
    _raise_for(status, "gemv")
    return y


def dequantize(kernels: KernelSet, weight: Blocks, rows: tuple[int, int], out: Tensor) -> Tensor:
    """Weight rows [rows) dense into `out` [rows, k] (fp32 or bf16), overwritten and returned."""
    first, last = rows
    if not 0 <= first < last <= weight.n:
        raise ValueError(f"rows {rows} of a weight of {weight.n}")
    _check(out, (last - first, weight.k), (torch.float32, torch.bfloat16), "out")
    status = kernels.fn("dequant")(
        weight.code, weight.data.data_ptr(), weight.data.shape[1], weight.k, first, last,
        out.data_ptr(), weight.k, ELEMENT_TYPES[out.dtype],
    )  # fmt: skip
    _raise_for(status, "dequant")
    return out


def dequantize_rows(kernels: KernelSet, weight: Blocks, ids: Tensor) -> Tensor:
    """Rows `ids` [count] of a weight, dense fp32 [count, k]: an embedding lookup."""
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"row ids {tuple(ids.shape)} {ids.dtype}")
    ids = ids.contiguous()
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < weight.n:
        raise ValueError(f"row ids outside [0, {weight.n})")
    out = torch.empty(ids.numel(), weight.k, dtype=torch.float32)
    status = kernels.fn("dequant_rows")(
        weight.code, weight.data.data_ptr(), weight.data.shape[1], weight.k,
        ids.data_ptr(), ids.numel(), out.data_ptr(),
    )  # fmt: skip
    _raise_for(status, "dequant_rows")
    return out


def regroup_rows_x8(kernels: KernelSet, weight: Blocks) -> Blocks:
    """A weight (any type but Q5_0) of a multiple of 8 rows with its rows regrouped
    eight at a time, in place (formats.py, ROWS_X8): the same tensor, its rows no longer as
    stored."""
    if weight.rows_x8:
        return weight
    status = kernels.lib.pc_rows_x8(
        weight.code, weight.data.data_ptr(), weight.data.shape[1], weight.n, 1
    )
    _raise_for(status, "rows_x8")
    return Blocks(weight.kind, weight.data, weight.k, rows_x8=True)


def rms_norm(kernels: KernelSet, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of each row of x [..., d] scaled by weight [d], fp32 in and out. Not checked
    beyond dtype and shape: it runs twice a layer, on the model's own CPU tensors."""
    d = weight.shape[0]
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.shape[-1] != d:
        raise ValueError(f"rms_norm of {tuple(x.shape)} {x.dtype} by {tuple(weight.shape)}")
    x = x.contiguous()
    out = torch.empty_like(x)
    kernels.fn("rms_norm")(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // d, d, eps)
    return out


def silu_mul(kernels: KernelSet, gate_up: Tensor) -> Tensor:
    """SiLU(gate) * up of gate_up [m, 2 inter] (each row [gate; up]): [m, inter] fp32."""
    return _gated(kernels, "silu_mul", gate_up)


def gelu_tanh_mul(kernels: KernelSet, gate_up: Tensor) -> Tensor:
    """GELU(gate) * up, GELU's tanh approximation (torch's gelu(approximate="tanh")), of
    gate_up [m, 2 inter] (each row [gate; up]): [m, inter] fp32."""
    return _gated(kernels, "gelu_tanh_mul", gate_up)


def _gated(kernels: KernelSet, kernel: str, gate_up: Tensor) -> Tensor:
    if gate_up.dtype != torch.float32 or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} {gate_up.dtype}")
    gate_up = gate_up.contiguous()
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, inter, dtype=torch.float32)
    kernels.fn(kernel)(gate_up.data_ptr(), out.data_ptr(), inter, 0, m * inter)
    return out


def sample(
    kernels: KernelSet,
    logits: Tensor,  # [R, V] fp32
    allowed: Tensor,  # [R, W] int32: bit j of word w allows id 32 w + j
    temperatures: Tensor,  # [R] fp32; <= 0: the likeliest id
    min_p: Tensor,  # [R] fp32 in [0, 1]
    uniforms: Tensor,  # [R] float64 in [0, 1)
) -> Tensor:  # [R] int64
    """One id per row among those its bits allow (and above -inf): the first id of the
    largest logit at temperature 0, else a draw from the softmax at its temperature, less
    the ids under min_p times the likeliest's probability, by inverting the cumulative
    distribution at the row's uniform. -1 where a row allows no id."""
    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.device.type != "cpu":
        raise ValueError(f"logits {tuple(logits.shape)} {logits.dtype}: fp32 CPU rows")
    logits = logits.contiguous()  # a copy only of an expanded or strided view
    words = allowed.shape[1] if allowed.dim() == 2 else -1
    _check(allowed, (rows, words), (torch.int32,), "allowed")
    _check(temperatures, (rows,), (torch.float32,), "temperatures")
    _check(min_p, (rows,), (torch.float32,), "min_p")
    _check(uniforms, (rows,), (torch.float64,), "uniforms")
    out = torch.empty(rows, dtype=torch.int64)
    if rows == 0:
        return out
    status = kernels.fn("sample")(
        logits.data_ptr(), rows, vocab, vocab, allowed.data_ptr(), words,
        temperatures.data_ptr(), min_p.data_ptr(), uniforms.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    _raise_for(status, "sample")
    return out


def _check_cache(key_cache: Tensor, value_cache: Tensor) -> tuple[int, int]:
    """(hkv, d) of a pool's layer caches [blocks, block_size, hkv, d]."""
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError("the K and V caches differ in shape or dtype")
    if key_cache.dim() != 4 or key_cache.dtype not in ELEMENT_TYPES:
        raise ValueError(f"cache {tuple(key_cache.shape)} {key_cache.dtype}")
    for cache in (key_cache, value_cache):
        if not cache.is_contiguous() or cache.device.type != "cpu":
            raise ValueError("the caches must be contiguous CPU tensors")
    hkv, d = key_cache.shape[2], key_cache.shape[3]
    if d % 16 or d > MAX_HEAD_DIM:
        raise ValueError(f"head size {d}: the kernels take multiples of 16 up to {MAX_HEAD_DIM}")
    return hkv, d


def rope_write(
    kernels: KernelSet,
    qkv: Tensor,  # [m, (hq + 2 hkv) d] fp32, rotated in place
    num_q_heads: int,
    cos: Tensor,  # [m, d] fp32
    sin: Tensor,  # [m, d] fp32, signed for rotate_half
    slots: Tensor,  # [m] int64
    key_cache: Tensor,  # [blocks, block_size, hkv, d]
    value_cache: Tensor,
) -> None:
    """Q and K of each row rotated in place, then K and V written to the row's cache slot."""
    hkv, d = _check_cache(key_cache, value_cache)
    m = qkv.shape[0]
    _check(qkv, (m, (num_q_heads + 2 * hkv) * d), (torch.float32,), "qkv")
    _check(cos, (m, d), (torch.float32,), "cos")
    _check(sin, (m, d), (torch.float32,), "sin")
    _check(slots, (m,), (torch.int64,), "slots")
    if (
        m
        and not 0 <= int(slots.min()) <= int(slots.max()) < key_cache.shape[0] * key_cache.shape[1]
    ):
        raise ValueError("a write slot outside the cache")
    kernels.fn("rope_write")(
        qkv.data_ptr(), m, qkv.shape[1], num_q_heads, hkv, d, cos.data_ptr(), sin.data_ptr(),
        slots.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        ELEMENT_TYPES[key_cache.dtype],
    )  # fmt: skip


def paged_decode(
    kernels: KernelSet,
    query: Tensor,  # [B, Hq, D] fp32
    key_cache: Tensor,  # [N, bs, Hkv, D] fp32, fp16 or bf16, contiguous
    value_cache: Tensor,
    slots: Tensor,  # [B, C] int64: row b's first seq_lens[b] entries are its context slots
    seq_lens: Tensor,  # [B] int64, each in 1..C
    scale: float,
) -> Tensor:  # [B, Hq, D] fp32
    """Each sequence's one new query over its whole context, read in place through its cache
    slots (no gathered K/V copy, no padding computed). The caller guarantees the slots were
    written (the plan's); their values are not checked here, only shapes, dtypes, layout."""
    hkv, d = _check_cache(key_cache, value_cache)
    b, hq = query.shape[0], query.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads over {hkv} KV heads")
    query = query.contiguous()
    _check(query, (b, hq, d), (torch.float32,), "query")
    _check(slots, (b, slots.shape[1] if slots.dim() == 2 else -1), (torch.int64,), "slots")
    _check(seq_lens, (b,), (torch.int64,), "seq_lens")
    out = torch.empty_like(query)
    scores = torch.empty(hq * max(slots.shape[1], 1), dtype=torch.float32)
    attention = CAttention(
        q=query.data_ptr(), q_stride=hq * d, k_cache=key_cache.data_ptr(),
        v_cache=value_cache.data_ptr(), cache_type=ELEMENT_TYPES[key_cache.dtype],
        slots=slots.data_ptr(), slot_stride=slots.shape[1], seq_lens=seq_lens.data_ptr(),
        out=out.data_ptr(), scores=scores.data_ptr(), hq=hq, hkv=hkv, d=d, scale=scale,
    )  # fmt: skip
    _raise_for(kernels.fn("attend")(ctypes.byref(attention), 0, b, 0), "attend")
    return out


def _raise_for(status: int, kernel: str) -> None:
    if status == _NO_MEMORY:
        raise MemoryError(f"the {kernel} kernel could not allocate")
    if status:
        raise ValueError(f"the {kernel} kernel declined these shapes (status {status})")
