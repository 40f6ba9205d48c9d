"""The engine's one seam to the third tier, in two roles (after vLLM v1's KVConnectorBase_V1).

- `TierScheduler`, the scheduler side (no tensors): which of a waiting sequence's blocks to
  ask the tier for, whether that load is done, which of its blocks are still of use when the
  sequence is admitted, which dropped blocks are worth saving and which blocks a finished
  request leaves to save. The `Scheduler` calls it for loads and evictions, the `LLMEngine`
  when a request that persists finishes.
- `TierWorker`, the worker side (the pools' tensors, registered by the `ModelRunner`): the
  K/V themselves. Blocks leaving the pools are copied to the host and queued for writing;
  loaded runs are staged and copied into the device slots the block manager gave them.
- `TierState`: one sequence's dealings with the tier (`Sequence.tier`), kept by the
  scheduler side.

`KVTierConnector` opens the tier (`tier.py`: the storage and its threads) and holds both
roles: the engine hands `scheduler` to its Scheduler and `worker` to its ModelRunner, and
keeps the connector for stats, flush and close. Nothing else in the engine touches the tier.
The block manager (pure Python) knows only that dropped blocks are saved (`save_evicted`: a
SAVE op, issued before the op that reuses the slot) and that an admitted sequence's blocks
may arrive loaded (LOAD ops); those ops carry the work from one role to the other.

NOTE (reads before recompute): a waiting prompt whose prefix hit stops at least
MIN_LOAD_BLOCKS full blocks short of its end asks the tier for the blocks after the hit, once
per admission; a shorter gap is recomputed, as cheap as one step's delay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from service.engine.blocks import SAVE_KINDS, Block, BlockOp
from service.engine.kvtier.config import KVTierConfig
from service.engine.kvtier.record import BlockLayout
from service.engine.kvtier.tier import CLOSE_TIMEOUT_S, KVTier, LoadedRun, LoadTicket
from service.engine.values import KVTierStats, Tier

MIN_LOAD_BLOCKS = 4


@dataclass(slots=True, eq=False)
class TierState:
    """A sequence's load from the tier: set when the tier is asked (once per admission), and
    cleared when a recompute preemption lets it ask again."""

    start: int  # the first block asked for (the prefix hit's length then)
    ticket: LoadTicket | None  # the load in flight
    run: LoadedRun | None = None  # what it returned (blocks from `start` on), until admitted


class TieredSequence(Protocol):
    """A sequence as the tier sees it (service.engine.sequence.Sequence)."""

    num_computed_tokens: int
    block_table: list[Block | None]  # None never: the tier runs with one pool (window_blocks)
    block_hashes: list[int]
    tier: TierState | None

    @property
    def num_tokens(self) -> int: ...


@dataclass(slots=True, frozen=True)
class BlocksToSave:
    """A finished request's full blocks that the tier does not hold yet."""

    hashes: list[int]
    blocks: list[Block]


class TierScheduler:
    """The scheduler side: what the tier holds, what to load and what to save."""

    def __init__(self, tier: KVTier) -> None:
        self._tier = tier
        self.block_size = tier.layout.block_size

    # ------------------------------------------------------------------ loads

    def wants_load(self, seq: TieredSequence, num_hit_blocks: int) -> bool:
        """Whether to ask the tier for the blocks after `seq`'s prefix hit before admitting it
        (the NOTE above): not asked since it was admitted, and the gap wide enough."""
        return seq.tier is None and self._max_blocks(seq) - num_hit_blocks >= MIN_LOAD_BLOCKS

    def start_load(self, seq: TieredSequence, num_hit_blocks: int) -> None:
        """Ask for the blocks from the hit's end up to the prompt's last full block that
        leaves a token to compute; returns at once (the tier's reader fetches them)."""
        hashes = seq.block_hashes[num_hit_blocks : self._max_blocks(seq)]
        seq.tier = TierState(num_hit_blocks, self._tier.load(hashes))

    def load_done(self, seq: TieredSequence) -> bool:
        """Whether `seq`'s load has finished or timed out; its run, if any, is then kept for
        admission (a load given up keeps none)."""
        state = seq.tier
        assert state is not None and state.ticket is not None, "no load in flight"
        ticket = state.ticket
        if not ticket.done.is_set() and not self._tier.expired(ticket):
            return False
        state.run = None if ticket.cancelled else ticket.result
        state.ticket = None
        return True

    def loaded_run(self, seq: TieredSequence, num_hit_blocks: int) -> LoadedRun | None:
        """The part of `seq`'s loaded run that continues its prefix hit now.

        Blocks may have come or gone while it waited: a hit that reaches into the run shortens
        it; a hit that stops before the run starts leaves a gap, and the run is dropped.
        """
        state = seq.tier
        if state is None or state.run is None:
            return None
        run, offset = state.run, num_hit_blocks - state.start
        if offset < 0 or offset >= len(run):
            state.run = None
            return None
        return run.tail(offset) if offset else run

    def admitted(self, seq: TieredSequence) -> None:
        """`seq` took its blocks (its run, if any, is in the step's LOAD ops): let the run go."""
        if seq.tier is not None:
            seq.tier.run = None

    def preempted(self, seq: TieredSequence) -> None:
        """`seq` lost its blocks for recompute: they may be in the tier by now, so its next
        admission asks again."""
        seq.tier = None

    def cancel(self, seq: TieredSequence) -> None:
        """`seq` finished or was aborted: give up its load, drop its run."""
        state = seq.tier
        if state is None:
            return
        if state.ticket is not None:
            state.ticket.cancelled = True
            state.ticket = None
        state.run = None

    def begin_step(self) -> None:
        """Before the scheduler looks at the loads: `wait_for_load` then wakes for any load
        finishing after that look."""
        self._tier.load_finished.clear()

    def wait_for_load(self, timeout: float) -> None:
        """Block until a load finishes (or `timeout`): for an engine with nothing else to run."""
        self._tier.load_finished.wait(timeout)

    # ------------------------------------------------------------------ saves

    def saves_needed(self, ops: list[BlockOp]) -> list[BlockOp]:
        """A step's block ops without the SAVE ops of blocks the tier holds already."""
        if not any(op.kind in SAVE_KINDS for op in ops):
            return ops
        return [op for op in ops if not self._holds(op)]

    def request_finished(self, seq: TieredSequence) -> BlocksToSave | None:
        """The computed full blocks of `seq` (a request that persists, finishing now) that
        the tier does not hold yet; the worker side saves them before they are released."""
        num_full = seq.num_computed_tokens // self.block_size
        pairs = [
            (h, block)
            for h, block in zip(seq.block_hashes[:num_full], seq.block_table, strict=False)
            if block is not None and not self._tier.knows(h)
        ]
        if not pairs:
            return None
        return BlocksToSave([h for h, _ in pairs], [block for _, block in pairs])

    def _holds(self, op: BlockOp) -> bool:
        """A SAVE op of a block the tier holds already."""
        return (
            op.kind in SAVE_KINDS and op.block_hash is not None and self._tier.knows(op.block_hash)
        )

    def _max_blocks(self, seq: TieredSequence) -> int:
        """Full blocks a prefix may cover: one token is left to compute, for its logits."""
        return (seq.num_tokens - 1) // self.block_size


class TierWorker:
    """The worker side: K/V between the registered pools and the tier."""

    def __init__(self, tier: KVTier) -> None:
        self._tier = tier
        self._pools: dict[Tier, torch.Tensor] = {}

    def register_pools(self, device_pool: torch.Tensor, cpu_pool: torch.Tensor) -> None:
        """The runner's pools, [L, 2, blocks, bs, Hkv, D] each (vLLM's register_kv_caches)."""
        self._pools = {Tier.DEVICE: device_pool, Tier.CPU: cpu_pool}

    def save(self, tier: Tier, slots: list[int], hashes: list[int]) -> None:
        """Blocks about to be dropped from `tier`'s pool (SAVE ops): a host copy of their K/V
        is queued under `hashes`; the slots may be reused as soon as this returns."""
        pool = self._pools[tier]
        index = torch.tensor(slots, device=pool.device)
        self._tier.save(hashes, pool[:, :, index].cpu())  # a copy: [L, 2, n, bs, Hkv, D]

    def save_blocks(self, save: BlocksToSave) -> None:
        """A finished request's blocks, wherever each is now (device or CPU pool)."""
        self._tier.save(save.hashes, self._read(save.blocks))

    def stage(self, loaded: list[LoadedRun]) -> torch.Tensor | None:
        """A step's loaded runs as one tensor of rows [L, 2, rows, bs, Hkv, D] on the host, in
        the order of its LOAD ops' rows; None if it loads nothing."""
        if not loaded:
            return None
        if len(loaded) == 1:
            return loaded[0].data
        return torch.cat([run.data for run in loaded], dim=2)

    def load(self, staged: torch.Tensor, rows: list[int], slots: list[int]) -> None:
        """Copy staged `rows` into the device pool's `slots` (LOAD ops)."""
        pool = self._pools[Tier.DEVICE]
        every_row = rows == list(range(staged.shape[2]))  # the usual case: no gather
        data = staged if every_row else staged[:, :, torch.tensor(rows, dtype=torch.int64)]
        pool[:, :, torch.tensor(slots, dtype=torch.int64, device=pool.device)] = data.to(
            pool.device
        )

    def _read(self, blocks: list[Block]) -> torch.Tensor:
        """A host copy of `blocks`' K/V, in order: [L, 2, n, bs, Hkv, D]."""
        cpu_pool = self._pools[Tier.CPU]
        shape = (*cpu_pool.shape[:2], len(blocks), *cpu_pool.shape[3:])
        out = torch.empty(shape, dtype=cpu_pool.dtype)
        for tier, pool in self._pools.items():
            rows = [i for i, b in enumerate(blocks) if b.tier is tier]
            if rows:
                slots = torch.tensor([blocks[i].slot for i in rows], device=pool.device)
                out[:, :, torch.tensor(rows)] = pool[:, :, slots].cpu()
        return out


class KVTierConnector:
    """The third tier as the engine holds it: one KVTier and its two roles."""

    def __init__(self, tier: KVTier) -> None:
        self._tier = tier
        self.scheduler = TierScheduler(tier)
        self.worker = TierWorker(tier)

    @classmethod
    def open(cls, config: KVTierConfig, layout: BlockLayout) -> KVTierConnector:
        return cls(KVTier.open(config, layout))

    @property
    def layout(self) -> BlockLayout:
        return self._tier.layout

    def stats(self) -> KVTierStats:
        """The tier's counters, read now (its threads write them while the engine idles)."""
        return self._tier.stats()

    def flush(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every queued write is done (or `timeout`); True if none is left."""
        return self._tier.flush(timeout)

    def close(self) -> None:
        """Write what is queued, stop the tier's threads, close its backends (at shutdown)."""
        self._tier.close()
