"""The model runner: owns the KV pools, moves blocks, runs one forward per step.

Pools are `[layers, 2, num_blocks, block_size, kv_heads, head_dim]` (layer-major, so each
layer's K and V caches are contiguous for attention; a block move touches every layer with one
indexing op). The CPU pool is pinned on CUDA so swaps can overlap. The device pool holds one
block more than the block manager hands out: `scratch_block`, where the padding rows of a
captured decode batch (service/engine/cuda_graphs.py) write their K/V and attend. A model whose
sliding-window layers keep blocks of their own (service/engine/window_blocks.py) has a pair of
pools per layer group, each group its own block tables and slot mapping per step. With a third
tier (service/engine/kvtier) the runner holds its worker side (`TierWorker`, which it registers
its pools with) and hands it the step's SAVE ops (blocks about to be dropped) and LOAD ops
(blocks the tier returned, copied into their device slots).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.backend import AttentionBackend
from kernels.metadata import AttentionMetadata
from service.engine.blocks import SAVE_KINDS, Block, BlockOp, OpKind
from service.engine.model import DecoderModel, ModelArgs
from service.engine.scheduler import StepBatch
from service.engine.values import Tier
from service.engine.window_blocks import LayerGroups

if TYPE_CHECKING:
    from service.engine.kvtier.connector import TierWorker
    from service.engine.kvtier.tier import LoadedRun


@dataclass(slots=True)
class OpGroup:
    kind: OpKind
    src: list[int]
    dst: list[int]
    hashes: list[int] = field(default_factory=list)  # SAVE groups: each block's key
    group: int = 0  # the layer group whose pools the ops move (KVGroup)


def group_block_ops(ops: list[BlockOp]) -> list[OpGroup]:
    """Batch consecutive ops of one kind into single launches, keeping issue order semantics.

    A group is cut where batching would change the result: an op writing a slot already
    written in the group, or (for device-to-device copies) reading a slot the group writes.
    SAVE ops write no slot.
    """
    groups: list[OpGroup] = []
    written: set[int] = set()
    for op in ops:
        g = groups[-1] if groups else None
        reads_written = op.kind is OpKind.COPY and op.src in written
        other_kind = g is None or g.kind is not op.kind or g.group != op.group
        if g is None or other_kind or op.dst in written or reads_written:
            g = OpGroup(op.kind, [], [], group=op.group)
            groups.append(g)
            written = set()
        g.src.append(op.src)
        g.dst.append(op.dst)
        if op.kind in SAVE_KINDS:
            assert op.block_hash is not None
            g.hashes.append(op.block_hash)
        else:
            written.add(op.dst)
    return groups


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata  # the full-attention layers' (every layer's with one group)
    plan: object  # the attention backend's per-step plan; None where the native stack runs
    sample_rows: torch.Tensor  # [S] int64: row of each sampling chunk's last token
    native: bool = False  # every layer in one call of the runner's `decoder_stack`
    # The sliding-window layers' tables and plan where they have pools of their own (no
    # plan where the native stack runs).
    window_meta: AttentionMetadata | None = None
    window_plan: object = None


@dataclass(slots=True)
class KVPools:
    """One layer group's pools: `[layers, 2, blocks, bs, Hkv, D]` on the device (a scratch
    block past the manager's) and on the CPU."""

    layers: tuple[int, ...]  # the model's layers whose K/V these hold, in order
    device: torch.Tensor
    cpu: torch.Tensor

    @property
    def scratch_block(self) -> int:
        return int(self.device.shape[2]) - 1


@dataclass(slots=True)
class PagedLayerAttention:
    """The model's attention hook for one step: write the new K/V, attend through pages."""

    caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K and V [N, bs, Hkv, D]
    backend: AttentionBackend
    metas: tuple[AttentionMetadata, ...]  # per layer group (KVGroup)
    plans: tuple[object, ...]
    layer_groups: tuple[int, ...]  # per layer: its group
    scale: float
    windows: tuple[int | None, ...]  # per layer: its sliding window, or None

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        key_cache, value_cache = self.caches[layer]
        group = self.layer_groups[layer]
        meta = self.metas[group]
        self.backend.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        return self.backend.attend(
            q, key_cache, value_cache, meta, self.plans[group], self.scale, self.windows[layer]
        )


def table_slots(table: list[Block | None], passed_slot: int) -> list[int]:
    """A block table's physical block ids; `passed_slot` where the window has passed (never
    read: the window's attention starts after it)."""
    return [passed_slot if b is None else b.slot for b in table]


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        args: ModelArgs,
        *,
        block_size: int,
        num_device_blocks: int,
        num_cpu_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        backend: AttentionBackend,
        tier: TierWorker | None = None,
        decode_threads: int = 1,
        window_groups: LayerGroups | None = None,
        num_window_blocks: tuple[int, int] = (0, 0),
        eager_pools: bool = False,
    ) -> None:
        """`window_groups`: the layer split where the window layers keep pools of their own,
        `num_window_blocks` (device, CPU) blocks; None: one pair of pools for every layer.
        `eager_pools`: CPU-side pools written whole at start-up (`host_zeros` leaves them to
        take memory as their blocks are first written)."""
        self.model = model
        self.tier = tier  # the third tier's worker side, or None
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.scale = args.head_dim**-0.5
        self.layer_windows = args.layer_windows
        assert tier is None or window_groups is None, "the third tier keeps one pool"

        def pools(layers: tuple[int, ...], num_device: int, num_cpu: int) -> KVPools:
            shape = (len(layers), 2, 0, block_size, args.num_kv_heads, args.head_dim)
            device_shape, cpu_shape = (
                _with_blocks(shape, num_device + 1),
                _with_blocks(shape, num_cpu),
            )
            if device.type == "cuda":
                device_pool = torch.zeros(device_shape, dtype=dtype, device=device)
                cpu_pool = torch.zeros(cpu_shape, dtype=dtype, pin_memory=True)
            else:
                zeros = torch.zeros if eager_pools else host_zeros
                device_pool, cpu_pool = (
                    zeros(device_shape, dtype=dtype),
                    zeros(cpu_shape, dtype=dtype),
                )
            return KVPools(layers, device=device_pool, cpu=cpu_pool)

        self.pools: tuple[KVPools, ...]
        if window_groups is None:
            self.pools = (pools(tuple(range(args.num_layers)), num_device_blocks, num_cpu_blocks),)
        else:
            self.pools = (
                pools(window_groups.full, num_device_blocks, num_cpu_blocks),
                pools(window_groups.window, *num_window_blocks),
            )
        self.window_groups = window_groups
        # The full group's pools: every layer's with one group; what the tier registers.
        self.device_pool, self.cpu_pool = self.pools[0].device, self.pools[0].cpu
        # Never in a block table the manager builds (the full group's pool's last block).
        self.scratch_block = self.pools[0].scratch_block
        if tier is not None:
            tier.register_pools(self.device_pool, self.cpu_pool)
        # Views into the device pools, taken once: indexing a pool per layer and step cost
        # four ops on the decode hot path. The pools are written in place, never replaced.
        caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        groups: dict[int, int] = {}
        for group, pair in enumerate(self.pools):
            for layer, cache in zip(pair.layers, pair.device.unbind(0), strict=True):
                caches[layer] = (cache[0], cache[1])
                groups[layer] = group
        self.layer_caches = [caches[i] for i in range(args.num_layers)]
        self.layer_groups = tuple(groups[i] for i in range(args.num_layers))
        # Steps run every layer in one native call where the model can
        # (model.native_decoder_stack): at one row, the torch path's ~25 ops a layer cost
        # about as much as the layer's packed matmuls, and in a prefill chunk a third.
        self.decoder_stack = model.native_decoder_stack(
            self.layer_caches, decode_threads, self.layer_groups
        )

    @property
    def native_decode_threads(self) -> int:
        """The native stack's threads; 0 where decode steps run op by op."""
        return 0 if self.decoder_stack is None else self.decoder_stack.threads

    @staticmethod
    def block_bytes(
        args: ModelArgs, block_size: int, dtype: torch.dtype, num_layers: int | None = None
    ) -> int:
        """One block's bytes over `num_layers` layers (all the model's by default)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        layers = args.num_layers if num_layers is None else num_layers
        return layers * 2 * block_size * args.num_kv_heads * args.head_dim * itemsize

    def apply_block_ops(self, ops: list[BlockOp], loaded: list[LoadedRun]) -> None:
        """Carry out a step's block ops; `loaded` holds the K/V its LOAD ops copy in (required:
        any step may load, a pure decode step included). SAVE and LOAD groups go to the tier's
        worker side, in their place among the others."""
        tier = self.tier
        staged = tier.stage(loaded) if tier is not None else None  # [L, 2, rows, bs, Hkv, D]
        for g in group_block_ops(ops):
            if g.kind in SAVE_KINDS:
                if tier is not None:
                    pool = Tier.CPU if g.kind is OpKind.SAVE_CPU else Tier.DEVICE
                    tier.save(pool, g.src, g.hashes)
                continue
            if g.kind is OpKind.LOAD:
                assert tier is not None and staged is not None, "LOAD ops without loaded blocks"
                tier.load(staged, g.src, g.dst)
                continue
            src = torch.tensor(g.src, dtype=torch.int64)
            dst = torch.tensor(g.dst, dtype=torch.int64)
            pools = self.pools[g.group]
            if g.kind is OpKind.COPY:
                self.backend.copy_blocks(pools.device, src.to(self.device), dst.to(self.device))
            elif g.kind is OpKind.SWAP_OUT:
                self.backend.swap_blocks(pools.device, pools.cpu, src, dst)
            else:
                self.backend.swap_blocks(pools.cpu, pools.device, src, dst)
        if ops and self.device.type == "cuda":
            # Swap-outs read device slots the coming forward may overwrite: finish them first.
            torch.cuda.current_stream(self.device).synchronize()

    def prepare(self, batch: StepBatch) -> StepInputs:
        """Run the step's block moves; build the forward's inputs and attention plan."""
        self.apply_block_ops(batch.block_ops, batch.loaded)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        positions_from: list[int] = []  # each chunk's first position
        for chunk in batch.chunks:
            seq, n = chunk.seq, chunk.num_tokens
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            positions_from.append(start)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            if chunk.samples:
                sample_rows.append(len(input_ids) - 1)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        dev = self.device
        query_start_loc = torch.tensor(starts, dtype=torch.int32, device=dev)
        seq_lens_dev = torch.tensor(seq_lens, dtype=torch.int32, device=dev)

        def group_meta(tables: list[list[int]]) -> AttentionMetadata:
            slots = [
                table[p // bs] * bs + p % bs
                for table, start, end in zip(tables, positions_from, seq_lens, strict=True)
                for p in range(start, end)
            ]
            width = max(len(t) for t in tables)
            padded = [t + [0] * (width - len(t)) for t in tables]
            return AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                query_start_loc=query_start_loc,
                seq_lens=seq_lens_dev,
                block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
                block_size=bs,
                query_lens_host=query_lens,
                seq_lens_host=seq_lens,
            )

        meta = group_meta([table_slots(c.seq.block_table, 0) for c in batch.chunks])
        window_meta = None
        if len(self.pools) > 1:
            scratch = self.pools[1].scratch_block
            window_meta = group_meta(
                [table_slots(c.seq.window_block_table, scratch) for c in batch.chunks]
            )
        native = self._runs_natively(query_lens, seq_lens)
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            plan=None if native else self.backend.plan(meta),
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            native=native,
            window_meta=window_meta,
            window_plan=None if native or window_meta is None else self.backend.plan(window_meta),
        )

    def _runs_natively(self, query_lens: list[int], seq_lens: list[int]) -> bool:
        """A step the native stack takes: few enough rows, and contexts short enough for
        its attention, which reads each row's context itself (a prefill chunk's rows each
        read theirs, where torch's flash attention reads them once per block of rows)."""
        if self.decoder_stack is None or sum(query_lens) > MAX_NATIVE_ROWS:
            return False
        kernels = self.model.kernels
        if kernels is not None and kernels.batch_invariant:
            return True  # every row as if alone: never torch's attention over a block of rows
        return max(query_lens) == 1 or max(seq_lens) <= MAX_NATIVE_PREFILL_CONTEXT

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """The forward; logits [S, V] float32 of the chunks that sample."""
        hidden = self.forward(inputs)  # [T, H]
        rows = hidden[inputs.sample_rows]
        return self.model.compute_logits(rows)  # [S, V]

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Every layer over the step's tokens, K/V written through the pages; hidden [T, H]."""
        metas: tuple[AttentionMetadata, ...] = (inputs.meta,)
        plans: tuple[object, ...] = (inputs.plan,)
        if inputs.window_meta is not None:
            metas, plans = (inputs.meta, inputs.window_meta), (inputs.plan, inputs.window_plan)
        if inputs.native:
            assert self.decoder_stack is not None
            return self.model.forward_natively(
                inputs.input_ids, inputs.positions, self.decoder_stack, metas
            )
        attention = PagedLayerAttention(
            caches=self.layer_caches,
            backend=self.backend,
            metas=metas,
            plans=plans,
            layer_groups=self.layer_groups,
            scale=self.scale,
            windows=self.layer_windows,
        )
        hidden: torch.Tensor = self.model(inputs.input_ids, inputs.positions, attention)
        return hidden


# The most rows a step runs through the native stack (a prefill chunk's tokens count each):
# it beat the op-by-op path at every size tried (decode: docs/perf-history.md, "The native
# decode stack (`--decode-threads 1 | 2`), 2026-12-02, Intel Xeon with AVX512-VNNI"; prefill:
# docs/perf-history.md, "Prefill through the stack (AMD EPYC Zen 5, 11:30 UTC, commit not
# recorded)");
# the cap bounds its work area.
MAX_NATIVE_ROWS = 1024
# The longest context of a step with prefill chunks the stack takes (decode steps: any). It
# prefilled faster than the op-by-op path at every length measured, up to 4,000 tokens
# (docs/perf.md, "Every version side by side"): its attention reads each row's context itself,
# which over still longer contexts may lose to torch's flash attention.
MAX_NATIVE_PREFILL_CONTEXT = 8192


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the process holds only once they are written: calloc
    (through numpy) takes a large block as fresh zero pages from the system and leaves them
    untouched, where torch.zeros writes every byte. A KV pool then takes memory as its blocks
    are first used, as llama.cpp's does, not all of it at start-up."""
    if math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(math.prod(shape) * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def _with_blocks(shape: tuple[int, ...], num_blocks: int) -> tuple[int, ...]:
    return (*shape[:2], num_blocks, *shape[3:])
