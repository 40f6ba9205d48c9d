"""Every decoder layer of a step in one native call (stack.c, pc_decode_layers), on one or two
threads, through the kernel versions a `KernelSet` chose: decode rows and short prefill
chunks alike, each row with its own context."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.cpu import ops
from kernels.cpu.dispatch import KernelSet
from kernels.cpu.formats import Blocks
from kernels.metadata import AttentionMetadata

_STATUS = {
    ops._NO_MEMORY: (MemoryError, "pc_decode_layers could not allocate its work area"),
    ops._BAD_SHAPE: (ValueError, "pc_decode_layers declined these weights or head sizes"),
    3: (ValueError, "a write slot, block or length outside the KV pool"),
}


class CDecoderLayer(ctypes.Structure):
    """One decoder layer's weights and caches as pc_decode_layers reads them."""

    _fields_ = [
        ("proj", ops.CProjection * 4),  # qkv, o_proj, gate_up, down
        ("attn_norm", ctypes.c_void_p),
        ("mlp_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),  # [slots, Hkv, D] of the shape's cache_type
        ("v_cache", ctypes.c_void_p),
    ]


class CDecoderShape(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("num_q_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("rms_norm_eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cache_blocks", ctypes.c_int64),  # the KV pool's (set by DecoderStack)
        ("block_size", ctypes.c_int64),
        ("cache_type", ctypes.c_int64),
    ]


@dataclass(frozen=True, slots=True)
class StackRows:
    """A step's rows as the stack reads them, one per token: where its K/V go, the pages of
    its sequence and its context length (its position + 1: a prefill chunk's rows see the
    chunk's earlier tokens, written in the same layer before any row attends)."""

    slots: Tensor  # [M] int64
    block_tables: Tensor  # [M, W] int32: each row's sequence's table
    seq_lens: Tensor  # [M] int32
    block_size: int

    @classmethod
    def of(cls, meta: AttentionMetadata, positions: Tensor) -> StackRows:
        """The rows of a step's metadata; `positions` [M] are the tokens' positions."""
        tables = meta.block_tables
        if meta.max_query_len > 1:  # rows of a chunk share their sequence's table
            counts = torch.tensor(meta.query_lens_host, device=tables.device)
            tables = tables.index_select(0, torch.repeat_interleave(counts)).contiguous()
        lens = (positions + 1).to(torch.int32)
        return cls(meta.slot_mapping, tables, lens, meta.block_size)


@dataclass(frozen=True, slots=True)
class StackLayer:
    """The tensors of one layer the stack reads: each must outlive the stack (it keeps their
    addresses, and holds these references so that they do)."""

    projections: tuple[Sequence[Blocks], ...]  # qkv, o_proj, gate_up, down: each its parts
    attn_norm: Tensor  # [hidden] fp32
    mlp_norm: Tensor
    key_cache: Tensor  # [N, bs, Hkv, D] fp32, fp16 or bf16, contiguous
    value_cache: Tensor


class DecoderStack:
    """Every decoder layer of a step in one call of pc_decode_layers.

    Built once per model and KV pool: the layers' addresses go into a C array here, and each
    step passes only its rows. The library checks every projection's types and sizes, the
    head size and each step's slots, blocks and lengths against the pool before it writes."""

    def __init__(
        self,
        kernels: KernelSet,
        shape: CDecoderShape,
        layers: list[StackLayer],
        threads: int = 1,
    ) -> None:
        if threads not in (1, 2):
            raise ValueError(f"the stack runs on one or two threads, not {threads}")
        if len(layers) != shape.num_layers:
            raise ValueError(f"{len(layers)} layers for a shape of {shape.num_layers}")
        pool = layers[0].key_cache  # [N, bs, Hkv, D]: every layer's alike
        if pool.dtype not in ops.ELEMENT_TYPES:
            raise ValueError(f"a {pool.dtype} cache")
        table = (CDecoderLayer * len(layers))()
        for entry, layer in zip(table, layers, strict=True):
            if len(layer.projections) != 4:
                raise ValueError("a layer has four projections: qkv, o_proj, gate_up, down")
            for i, parts in enumerate(layer.projections):
                entry.proj[i] = ops.projection(parts)
            for t in (layer.attn_norm, layer.mlp_norm):
                ops._check(t, (shape.hidden,), (torch.float32,), "norm weight")
            for cache in (layer.key_cache, layer.value_cache):
                ops._check(cache, tuple(pool.shape), (pool.dtype,), "cache")
            entry.attn_norm, entry.mlp_norm = layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr()
            entry.k_cache, entry.v_cache = layer.key_cache.data_ptr(), layer.value_cache.data_ptr()
        shape.cache_blocks, shape.block_size = pool.shape[0], pool.shape[1]
        shape.cache_type = ops.ELEMENT_TYPES[pool.dtype]
        self.kernels = kernels
        self.shape = shape
        self._table = table
        self._layers = layers  # keeps what the table points at alive
        # Two: each projection, the attention and SiLU split with the library's helper thread.
        self.threads = threads
        # Set to a ctypes.c_int64 to have each call add its GEMVs' nanoseconds to it.
        self.matmul_ns: ctypes.c_int64 | None = None

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, rows: StackRows) -> Tensor:
        """x [M, hidden] fp32 (the residual stream, updated in place and returned), cos and
        sin [M, D] (each row's RoPE rows, sin signed for rotate_half), `rows` each row's
        write slot, pages and context length: any mix of decode rows and prefill chunks."""
        m = x.shape[0]
        if rows.block_size != self.shape.block_size:
            raise ValueError(f"blocks of {rows.block_size} for a pool of {self.shape.block_size}")
        ops._check(x, (m, self.shape.hidden), (torch.float32,), "x")
        ops._check(cos, (m, self.shape.head_dim), (torch.float32,), "cos")
        ops._check(sin, (m, self.shape.head_dim), (torch.float32,), "sin")
        slots, tables, lens = rows.slots, rows.block_tables, rows.seq_lens
        ops._check(slots, (m,), (torch.int64,), "slots")
        ops._check(tables, (m, tables.shape[1]), (torch.int32,), "block_tables")
        ops._check(lens, (m,), (torch.int32,), "seq_lens")
        status = self.kernels.lib.pc_decode_layers(
            ctypes.byref(self.kernels.table),
            self._table,
            ctypes.byref(self.shape),
            x.data_ptr(),
            m,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            self.threads,
            None if self.matmul_ns is None else ctypes.byref(self.matmul_ns),
        )
        if status:
            error, message = _STATUS.get(status, (RuntimeError, f"status {status}"))
            raise error(message)
        return x
