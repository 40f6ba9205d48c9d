"""Every decoder layer of a step in one native call (stack.c, pc_decode_layers), on one to 64
threads, through the kernel versions a `KernelSet` chose: decode rows and short prefill
chunks alike, each row with its own context, for every family `ModelArgs` describes (biases,
q/k norms, sandwich norms, tanh-GELU, an attention scale, per-layer RoPE tables and sliding
windows, the window layers' K/V in pools of their own)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.cpu import ops, topology
from kernels.cpu.dispatch import KernelSet
from kernels.cpu.formats import Blocks
from kernels.cpu.structs import (
    MAX_GROUPS,
    MAX_ROPES,
    CDecoderLayer,
    CDecoderShape,
    CStepRows,
)
from kernels.metadata import AttentionMetadata

_STATUS = {
    ops._NO_MEMORY: (MemoryError, "pc_decode_layers could not allocate its work area"),
    ops._BAD_SHAPE: (ValueError, "pc_decode_layers declined these weights, heads or rows"),
    3: (ValueError, "a write slot, block or length outside the KV pool"),
}
# The MLP's activations the stack takes, as pagechat_cpu.h numbers them.
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


@dataclass(frozen=True, slots=True)
class GroupRows:
    """A step's rows in one layer group's pool: where each row's K/V go, its sequence's pages."""

    slots: Tensor  # [M] int64
    block_tables: Tensor  # [M, W] int32: each row's sequence's table


@dataclass(frozen=True, slots=True)
class StackRows:
    """A step's rows as the stack reads them, one per token: per layer group where its K/V go
    and the pages of its sequence, and its context length (its position + 1: a prefill
    chunk's rows see the chunk's earlier tokens, written in the same layer before any row
    attends)."""

    groups: tuple[GroupRows, ...]  # the runner's layer groups' (KVGroup), in order
    seq_lens: Tensor  # [M] int32
    block_size: int

    @classmethod
    def of(cls, metas: Sequence[AttentionMetadata], positions: Tensor) -> StackRows:
        """The rows of a step's metadata, one per layer group; `positions` [M] are the
        tokens' positions."""
        first = metas[0]
        rows = None
        if first.max_query_len > 1:  # rows of a chunk share their sequence's table
            counts = torch.tensor(first.query_lens_host, device=first.block_tables.device)
            rows = torch.repeat_interleave(counts)
        groups = []
        for meta in metas:
            tables = meta.block_tables
            if rows is not None:
                tables = tables.index_select(0, rows).contiguous()
            groups.append(GroupRows(meta.slot_mapping, tables))
        lens = (positions + 1).to(torch.int32)
        return cls(tuple(groups), lens, first.block_size)


@dataclass(frozen=True, slots=True)
class StackLayer:
    """The tensors of one layer the stack reads, and which pool, RoPE table and window it
    uses: each tensor must outlive the stack (it keeps their addresses, and holds these
    references so that they do). None: a feature the family lacks."""

    projections: tuple[Sequence[Blocks], ...]  # qkv, o_proj, gate_up, down: each its parts
    attn_norm: Tensor  # [hidden] fp32
    mlp_norm: Tensor
    key_cache: Tensor  # [N, bs, Hkv, D] fp32, fp16 or bf16, contiguous: its group's pool
    value_cache: Tensor
    qkv_bias: Tensor | None = None  # [q_size + 2 kv_size] fp32
    o_bias: Tensor | None = None  # [hidden]
    q_norm: Tensor | None = None  # [D]: each head of q normed before RoPE
    k_norm: Tensor | None = None
    post_attn_norm: Tensor | None = None  # [hidden]: each sublayer's output normed
    post_mlp_norm: Tensor | None = None
    group: int = 0  # its layer group: the pool its caches are in, the step's rows it reads
    rope: int = 0  # the RoPE rows (of those each call passes) it rotates by
    window: int | None = None  # keys a row sees, its own included; None: all


class DecoderStack:
    """Every decoder layer of a step in one call of pc_decode_layers.

    Built once per model and KV pools: the layers' addresses go into a C array here, and each
    step passes only its rows. The library checks every projection's types and sizes, the
    head size and each step's slots, blocks and lengths against each group's pool before it
    writes."""

    def __init__(
        self,
        kernels: KernelSet,
        shape: CDecoderShape,
        layers: list[StackLayer],
        threads: int = 1,
    ) -> None:
        if not 1 <= threads <= topology.MAX_THREADS:
            raise ValueError(f"the stack runs on 1 to {topology.MAX_THREADS} threads: {threads}")
        if len(layers) != shape.num_layers:
            raise ValueError(f"{len(layers)} layers for a shape of {shape.num_layers}")
        pools = _group_pools(layers)
        table = (CDecoderLayer * len(layers))()
        for entry, layer in zip(table, layers, strict=True):
            _fill_layer(entry, layer, shape, pools[layer.group])
        first = pools[0]  # [N, bs, Hkv, D]: every pool's block size and dtype alike
        shape.block_size, shape.cache_type = first.shape[1], ops.ELEMENT_TYPES[first.dtype]
        shape.groups = len(pools)
        for group, pool in enumerate(pools):
            if pool.shape[1:] != first.shape[1:] or pool.dtype != first.dtype:
                raise ValueError("every group's pool has one block size, head layout and dtype")
            shape.cache_blocks[group] = pool.shape[0]
        self.kernels = kernels
        self.shape = shape
        self.ropes = 1 + max(layer.rope for layer in layers)
        self._table = table
        self._layers = layers  # keeps what the table points at alive
        # More than one: each projection, the attention and the activation split with the
        # library's helper threads.
        self.threads = threads
        # Set to a ctypes.c_int64 to have each call add its GEMVs' nanoseconds to it.
        self.matmul_ns: ctypes.c_int64 | None = None

    def __call__(
        self, x: Tensor, ropes: Sequence[tuple[Tensor, Tensor]], rows: StackRows
    ) -> Tensor:
        """x [M, hidden] fp32 (the residual stream, updated in place and returned), `ropes`
        each RoPE table's cos and sin rows [M, D] (sin signed for rotate_half), indexed by the
        layers' `rope`, `rows` each row's write slots, pages and context length: any mix of
        decode rows and prefill chunks."""
        m, shape = x.shape[0], self.shape
        if rows.block_size != shape.block_size:
            raise ValueError(f"blocks of {rows.block_size} for a pool of {shape.block_size}")
        if len(rows.groups) != shape.groups or not self.ropes <= len(ropes) <= MAX_ROPES:
            raise ValueError(
                f"{len(rows.groups)} groups' rows and {len(ropes)} RoPE tables for a stack of"
                f" {shape.groups} groups whose layers rotate by {self.ropes}"
            )
        ops._check(x, (m, shape.hidden), (torch.float32,), "x")
        ops._check(rows.seq_lens, (m,), (torch.int32,), "seq_lens")
        step = CStepRows(m=m, seq_lens=rows.seq_lens.data_ptr())
        for i, (cos, sin) in enumerate(ropes):
            ops._check(cos, (m, shape.head_dim), (torch.float32,), "cos")
            ops._check(sin, (m, shape.head_dim), (torch.float32,), "sin")
            step.cos[i], step.sin[i] = cos.data_ptr(), sin.data_ptr()
        for g, group in enumerate(rows.groups):
            tables = group.block_tables
            ops._check(group.slots, (m,), (torch.int64,), "slots")
            ops._check(tables, (m, tables.shape[1]), (torch.int32,), "block_tables")
            step.write_slots[g], step.block_tables[g] = group.slots.data_ptr(), tables.data_ptr()
            step.table_width[g] = tables.shape[1]
        status = self.kernels.lib.pc_decode_layers(
            ctypes.byref(self.kernels.table),
            self._table,
            ctypes.byref(shape),
            x.data_ptr(),
            ctypes.byref(step),
            self.threads,
            None if self.matmul_ns is None else ctypes.byref(self.matmul_ns),
        )
        if status:
            error, message = _STATUS.get(status, (RuntimeError, f"status {status}"))
            raise error(message)
        return x


def _group_pools(layers: list[StackLayer]) -> list[Tensor]:
    """Each layer group's pool (a K cache of one of its layers), groups numbered from 0."""
    pools: dict[int, Tensor] = {}
    for layer in layers:
        pools.setdefault(layer.group, layer.key_cache)
    if sorted(pools) != list(range(len(pools))) or len(pools) > MAX_GROUPS:
        raise ValueError(f"layer groups {sorted(pools)}: 0 to {MAX_GROUPS - 1}, each with a layer")
    pool = pools[0]
    if pool.dtype not in ops.ELEMENT_TYPES:
        raise ValueError(f"a {pool.dtype} cache")
    return [pools[g] for g in range(len(pools))]


def _fill_layer(
    entry: CDecoderLayer, layer: StackLayer, shape: CDecoderShape, pool: Tensor
) -> None:
    """The C entry of one layer, its tensors checked."""
    if len(layer.projections) != 4:
        raise ValueError("a layer has four projections: qkv, o_proj, gate_up, down")
    if not 0 <= layer.rope < MAX_ROPES or (layer.window is not None and layer.window < 1):
        raise ValueError(f"RoPE table {layer.rope}, window {layer.window}")
    for i, parts in enumerate(layer.projections):
        entry.proj[i] = ops.projection(parts)
    for cache in (layer.key_cache, layer.value_cache):
        ops._check(cache, tuple(pool.shape), (pool.dtype,), "cache")
    entry.k_cache, entry.v_cache = layer.key_cache.data_ptr(), layer.value_cache.data_ptr()
    d, hidden = shape.head_dim, shape.hidden
    qkv_size = (shape.num_q_heads + 2 * shape.num_kv_heads) * d
    sizes = {
        "attn_norm": hidden, "mlp_norm": hidden, "qkv_bias": qkv_size, "o_bias": hidden,
        "q_norm": d, "k_norm": d, "post_attn_norm": hidden, "post_mlp_norm": hidden,
    }  # fmt: skip
    for name, size in sizes.items():
        t = getattr(layer, name)
        if t is not None:
            ops._check(t, (size,), (torch.float32,), name)
            setattr(entry, name, t.data_ptr())
    entry.group, entry.rope, entry.window = layer.group, layer.rope, layer.window or 0
