"""The per-step description of a mixed batch that every attention backend reads.

The runner builds one `AttentionMetadata` per step; all layers share it. A batch is a run of
sequences, each contributing `query_len` new tokens (a prefill chunk, or 1 for decode) that sit
at the end of its `seq_len` tokens of context. The new tokens' K/V are written into the cache
first, so attention reads the whole context, new tokens included, through the block table.

Cache layout (per layer): key_cache / value_cache are `[num_blocks, block_size, kv_heads,
head_dim]`; slot `s` is block `s // block_size`, offset `s % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: seq i owns query rows [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32: physical block ids, padded with 0
    block_size: int
    # Host copies, so backends can plan without a device-to-host sync.
    query_lens_host: list[int]
    seq_lens_host: list[int]

    def __post_init__(self) -> None:
        num_seqs = len(self.seq_lens_host)
        if len(self.query_lens_host) != num_seqs:
            raise ValueError("query_lens_host and seq_lens_host differ in length")
        if self.query_start_loc.shape != (num_seqs + 1,):
            raise ValueError(f"query_start_loc must be [{num_seqs + 1}]")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != num_seqs:
            raise ValueError(f"block_tables must be [{num_seqs}, max_blocks]")
        for q, s in zip(self.query_lens_host, self.seq_lens_host, strict=True):
            if not 0 < q <= s:
                raise ValueError(f"query_len {q} must be in 1..seq_len ({s})")
            if s > self.block_tables.shape[1] * self.block_size:
                raise ValueError(f"seq_len {s} exceeds the block table's capacity")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)
