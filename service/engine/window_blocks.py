"""KV blocks of a model with sliding-window layers: one pool and block table per layer group.

A full-attention layer reads every position, a sliding-window layer only its last `window`
ones. Kept in one pool, a 4k-token Gemma 3 conversation holds all 4k positions in every layer;
here the window layers' K/V live in a pool of their own (`KVGroup.WINDOW`) whose blocks each
sequence releases as soon as every later token is past them, so those layers hold about one
window a sequence (vLLM's hybrid allocator keeps a block table per layer group the same way).
Each group is a `BlockManager` of its own; `WindowedBlockManager` drives both with the one
manager's interface, so the scheduler and the engine do not know there are two.

NOTE (which blocks pass): a step whose first new token sits at position p reads keys from
p - window + 1 on (its later rows read later keys still). The window group's blocks that end
before that are released as the step is scheduled (`BlockManager.release_leading`); hashed ones
stay cached for prefix hits like a finished sequence's. Only full-attention layers and windowed
ones side by side are split (Gemma 2 / 3): a model whose every layer is windowed keeps one pool.
NOTE (prefix hits): a hit of k blocks needs the full group's blocks [0, k) and the window
group's blocks that position k * block_size still sees. The full group finds the longest run
from the start; the hit is then the longest k within it for which the window group holds those
blocks (their own earlier blocks may be gone: evicted, or passed and dropped).
NOTE (what stays whole): the page maps, the /kv view and the third tier see the full group,
which holds every position; the engine keeps the one-pool layout where a third tier is
configured, whose records hold every layer of a block.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from service.engine.blocks import Block, BlockManager, BlockOp, PagedSequence, PrefixHit
from service.engine.values import BlockStats, CacheScope, SlotState, Tier


class KVGroup(enum.IntEnum):
    """The layer groups with a pool each; a `BlockOp`'s `group` says whose pools it moves."""

    FULL = 0
    WINDOW = 1


@dataclass(slots=True, frozen=True)
class LayerGroups:
    """Which layers read every position and which a sliding window of it."""

    full: tuple[int, ...]
    window: tuple[int, ...]
    window_size: int  # the widest window among the windowed layers (all share it in Gemma)

    @classmethod
    def of(cls, layer_windows: tuple[int | None, ...]) -> LayerGroups | None:
        """The split of a model's layers; None unless it has layers of both kinds."""
        full = tuple(i for i, w in enumerate(layer_windows) if w is None)
        window = tuple(i for i, w in enumerate(layer_windows) if w is not None)
        if not full or not window:
            return None
        return cls(full, window, max(w for w in layer_windows if w is not None))

    def group_of(self, layer: int) -> tuple[KVGroup, int]:
        """The group of `layer` and its index among the group's layers."""
        if layer in self.window:
            return KVGroup.WINDOW, self.window.index(layer)
        return KVGroup.FULL, self.full.index(layer)

    def blocks_seen(self, block_size: int) -> int:
        """The most blocks one position's window spans (the window's blocks plus a partial
        one at each end)."""
        return -(-(self.window_size - 1) // block_size) + 1

    def passed_blocks(self, position: int, block_size: int) -> int:
        """How many leading blocks no query at `position` or later reads."""
        return max(0, position - self.window_size + 1) // block_size


@dataclass(slots=True, frozen=True)
class PoolSizes:
    """Blocks of every pool: the full group's (every layer's with one group) and the window
    group's (0 without one)."""

    device: int
    cpu: int
    window_device: int = 0
    window_cpu: int = 0


def pool_sizes(
    *,
    layer_bytes: int,
    num_layers: int,
    groups: LayerGroups | None,
    device_bytes: int,
    cpu_bytes: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> PoolSizes:
    """Split the device and CPU budgets (bytes) between the groups' pools.

    A sequence never holds more window-group blocks than full-group ones, so an equal count
    of blocks in both (what one pool for every layer holds) is never short. The window pool is
    cut below that only as far as it still holds, for every sequence of a full batch, the
    blocks its window sees and as many again (cached windows, for returning conversations'
    prefix hits), plus one step's prefill chunk; the bytes it leaves go to the full group.
    The CPU pools keep equal counts: swapped sequences hold what they held on the device.
    """
    equal = max(1, device_bytes // (layer_bytes * num_layers))
    equal_cpu = cpu_bytes // (layer_bytes * num_layers)
    if groups is None:
        return PoolSizes(equal, equal_cpu)
    per_seq = groups.blocks_seen(block_size) + 1  # and the block its next token opens
    window = 2 * max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)
    if window >= equal:
        return PoolSizes(equal, equal_cpu, equal, equal_cpu)
    left = device_bytes - window * layer_bytes * len(groups.window)
    full = left // (layer_bytes * len(groups.full))
    return PoolSizes(full, equal_cpu, window, equal_cpu)


class WindowTable:
    """A sequence as the window group's manager sees it: its tokens, and the window group's
    block table and registration count in place of the full group's."""

    __slots__ = ("seq",)

    def __init__(self, seq: WindowedSequence) -> None:
        self.seq = seq

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self.seq.num_computed_tokens = value

    @property
    def cache_scope(self) -> CacheScope | None:
        return self.seq.cache_scope

    @property
    def block_table(self) -> list[Block | None]:
        return self.seq.window_block_table

    @property
    def block_hashes(self) -> list[int]:
        # One chain of hashes: both groups' blocks at a position hold the same tokens.
        return self.seq.block_hashes

    @property
    def num_registered_blocks(self) -> int:
        return self.seq.num_window_registered_blocks

    @num_registered_blocks.setter
    def num_registered_blocks(self, value: int) -> None:
        self.seq.num_window_registered_blocks = value

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens


class WindowedSequence(PagedSequence, Protocol):
    """A sequence with a second block table, for the window group (service.engine.sequence)."""

    window_block_table: list[Block | None]
    num_window_registered_blocks: int


class WindowedBlockManager:
    """Two `BlockManager`s, one per layer group, behind the one manager's interface."""

    def __init__(self, full: BlockManager, window: BlockManager, groups: LayerGroups) -> None:
        if full.block_size != window.block_size or full.namespace != window.namespace:
            raise ValueError("both groups need one block size and namespace")
        if full.save_evicted or window.save_evicted:
            raise ValueError("a third tier keeps the one-pool layout")
        self.full = full
        self.window = window
        self.groups = groups
        self.block_size = full.block_size
        self.namespace = full.namespace
        self.mode = full.mode
        self.enable_prefix_caching = full.enable_prefix_caching

    # ------------------------------------------------------------------ admission

    def find_prefix(self, seq: WindowedSequence) -> PrefixHit:
        """The full group's hit, cut to where the window group holds what it still sees."""
        hit = self.full.find_prefix(seq)
        bs = self.block_size
        for k in range(len(hit.blocks), 0, -1):
            passed = self.groups.passed_blocks(k * bs, bs)
            seen = self.window.cached_blocks(seq.block_hashes[passed:k])
            if seen is not None:
                blocks = hit.blocks[:k]
                return PrefixHit(
                    blocks,
                    bs,
                    sum(b.tier is Tier.CPU for b in blocks),
                    window=PrefixHit(
                        tuple(seen), bs, sum(b.tier is Tier.CPU for b in seen), passed=passed
                    ),
                )
        return PrefixHit(block_size=bs, window=PrefixHit(block_size=bs))

    def can_allocate(
        self, seq: WindowedSequence, hit: PrefixHit, num_new_tokens: int, num_loaded: int = 0
    ) -> bool:
        assert num_loaded == 0 and hit.window is not None
        return self.full.can_allocate(seq, hit, num_new_tokens) and self.window.can_allocate(
            WindowTable(seq), hit.window, num_new_tokens
        )

    def allocate(
        self,
        seq: WindowedSequence,
        hit: PrefixHit,
        num_new_tokens: int,
        *,
        loaded: list[int] | tuple[int, ...] = (),
        count_lookup: bool = True,
    ) -> None:
        assert not loaded and hit.window is not None
        self.full.allocate(seq, hit, num_new_tokens, count_lookup=count_lookup)
        self.window.allocate(WindowTable(seq), hit.window, num_new_tokens, count_lookup=False)

    # ------------------------------------------------------------------ growth

    def can_append(self, seq: WindowedSequence, num_new_tokens: int) -> bool:
        return self.full.can_append(seq, num_new_tokens) and self.window.can_append(
            WindowTable(seq), num_new_tokens
        )

    def append_slots(self, seq: WindowedSequence, num_new_tokens: int) -> None:
        table = WindowTable(seq)
        self.full.append_slots(seq, num_new_tokens)
        self.window.append_slots(table, num_new_tokens)
        passed = self.groups.passed_blocks(seq.num_computed_tokens, self.block_size)
        self.window.release_leading(table, passed)

    def fork(self, parent: WindowedSequence, child: WindowedSequence) -> None:
        self.full.fork(parent, child)
        self.window.fork(WindowTable(parent), WindowTable(child))

    def can_fork(self, parent: WindowedSequence) -> bool:
        return self.full.can_fork(parent) and self.window.can_fork(WindowTable(parent))

    # ------------------------------------------------------------------ release, swap

    def free(self, seq: WindowedSequence) -> None:
        self.full.free(seq)
        self.window.free(WindowTable(seq))

    def can_swap_out(self, seq: WindowedSequence) -> bool:
        return self.full.can_swap_out(seq) and self.window.can_swap_out(WindowTable(seq))

    def swap_out(self, seq: WindowedSequence) -> None:
        self.full.swap_out(seq)
        self.window.swap_out(WindowTable(seq))

    def can_swap_in(self, seq: WindowedSequence, num_new_tokens: int) -> bool:
        return self.full.can_swap_in(seq, num_new_tokens) and self.window.can_swap_in(
            WindowTable(seq), num_new_tokens
        )

    def swap_in(self, seq: WindowedSequence) -> None:
        self.full.swap_in(seq)
        self.window.swap_in(WindowTable(seq))

    # ------------------------------------------------------------------ per step, reports

    def take_ops(self) -> list[BlockOp]:
        """Both groups' ops: each group's in issue order (they touch different pools)."""
        window_ops = [
            dataclasses.replace(op, group=KVGroup.WINDOW) for op in self.window.take_ops()
        ]
        return self.full.take_ops() + window_ops

    def stats(self) -> BlockStats:
        """The full group's pools and prefix counters (it holds every position), the window
        group's pools beside them, block moves of both."""
        full, window = self.full.stats(), self.window.stats()
        return dataclasses.replace(
            full,
            window_device=window.device,
            window_cpu=window.cpu,
            blocks_swapped_out=full.blocks_swapped_out + window.blocks_swapped_out,
            blocks_swapped_in=full.blocks_swapped_in + window.blocks_swapped_in,
            blocks_copied=full.blocks_copied + window.blocks_copied,
            blocks_dropped=full.blocks_dropped + window.blocks_dropped,
        )

    def slot_states(self, tier: Tier) -> list[SlotState]:
        return self.full.slot_states(tier)

    def tier_of(self, block_hash: int) -> Tier | None:
        return self.full.tier_of(block_hash)

    @property
    def num_free_device_blocks(self) -> int:
        return self.full.num_free_device_blocks

    def is_idle_balanced(self) -> bool:
        return self.full.is_idle_balanced() and self.window.is_idle_balanced()

    def check_invariants(self, live: Iterable[WindowedSequence] | None = None) -> None:
        seqs = None if live is None else list(live)
        self.full.check_invariants(seqs)
        self.window.check_invariants(None if seqs is None else [WindowTable(s) for s in seqs])
