"""A sequence: the token ids of one sample of one request, and the KV blocks that hold them.

NOTE: `block_table` (and `window_block_table`) are owned by the sequence but only the block
manager mutates them; the scheduler moves sequences between queues; the engine appends sampled
tokens.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from service.engine.blocks import Block
from service.engine.params import SamplingParams
from service.engine.values import CacheScope, FinishReason

if TYPE_CHECKING:
    from service.engine.grammar import GrammarMatcher
    from service.engine.kvtier.connector import TierState
    from service.engine.token_counts import TokenCounts


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted for recompute
    LOADING = "loading"  # holds no blocks; waits for blocks of its prefix from the third tier
    RUNNING = "running"  # holds device blocks, scheduled every step
    SWAPPED = "swapped"  # preempted; its private blocks wait in the CPU pool
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    sample_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    cache_scope: CacheScope | None = None  # who may share its blocks (None: everyone)
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # Tokens whose K/V are in the cache; the rest are computed by upcoming steps.
    num_computed_tokens: int = 0
    block_table: list[Block | None] = field(default_factory=list)
    # Chain hash of every full block scheduled so far (the block manager extends it).
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks whose hashes the block manager has seen
    # The sliding-window layers' own table, where they have a pool of their own
    # (service/engine/window_blocks.py); None where their window has passed.
    window_block_table: list[Block | None] = field(default_factory=list)
    num_window_registered_blocks: int = 0
    # Where the prompt's tokens came from at (re)admission, for usage reports.
    num_cached_tokens: int = 0  # prefix-cache hits on the device
    num_swapped_in_tokens: int = 0  # prefix-cache hits brought back from the CPU pool
    num_loaded_tokens: int = 0  # prefix blocks loaded from the third tier
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # first admission (monotonic), for queue time
    # The third tier's load (kept by its scheduler side, kvtier/connector.py): None until the
    # tier is asked, once per admission; then the load in flight, or the run it returned
    # until the sequence is admitted.
    tier: TierState | None = None
    # Where its answer is in the grammar it must match (params.structured); None: free.
    grammar: GrammarMatcher | None = None
    # The distinct ids its penalties read, kept as tokens come (params.penalized; made at the
    # first sample).
    counts: TokenCounts | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, sample_index: int, generator: torch.Generator | None) -> Sequence:
        """A sibling sample with the same tokens; the block manager shares the blocks."""
        return Sequence(
            request_id=self.request_id,
            sample_index=sample_index,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            params=self.params,
            cache_scope=self.cache_scope,
            arrival_time=self.arrival_time,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            block_hashes=list(self.block_hashes),
            num_registered_blocks=self.num_registered_blocks,
            num_window_registered_blocks=self.num_window_registered_blocks,
            num_cached_tokens=self.num_cached_tokens,
            num_swapped_in_tokens=self.num_swapped_in_tokens,
            num_loaded_tokens=self.num_loaded_tokens,
            generator=generator,
            grammar=None if self.grammar is None else self.grammar.fork(),
            counts=None if self.counts is None else self.counts.copy(),
        )
