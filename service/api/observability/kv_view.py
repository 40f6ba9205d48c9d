"""The /v1/kv document: both KV pools slot by slot, and which sequence holds which slots.

It feeds the live view of the pools at /kv. Slot states are one character each (`.` free, `u` in
use, `s` shared by several tables, `c` cached for a prefix hit), so even a pool of tens of
thousands of blocks is a short string. Sequences are named by an opaque tag of their session
(the first 8 hex digits of its SHA-256) and the turn, never by the session id itself.
"""

from __future__ import annotations

import hashlib

import msgspec

from service.api.observability.stats import TierStats, tier_stats
from service.engine.values import KVSnapshot, KVTierStats, SlotState, Tier

SLOT_CHARS = {
    SlotState.FREE: ".",
    SlotState.IN_USE: "u",
    SlotState.SHARED: "s",
    SlotState.CACHED: "c",
}
TIER_CHARS = {Tier.DEVICE: "d", Tier.CPU: "c"}


class SequenceView(msgspec.Struct, kw_only=True):
    label: str  # session tag / turn (/ sample, for n > 1)
    status: str  # waiting, running or swapped
    tokens: int
    computed: int  # tokens whose K/V are cached
    blocks: list[str]  # "d12" = device slot 12, "c3" = CPU slot 3, in table order


class KVView(msgspec.Struct, kw_only=True):
    block_size: int
    device: str  # one character per device slot
    cpu: str  # one character per CPU slot
    sequences: list[SequenceView]
    num_sequences: int  # all live sequences; `sequences` may hold only the first ones
    kv_tier: TierStats | None = None  # the third tier's blocks and counters; null: none


def session_tag(session_id: str) -> str:
    """What the views call a session: enough to tell sessions apart, useless to resume one."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:8]


def _label(request_id: str, sample_index: int) -> str:
    # Chat turns are "<session id>/<turn>", tail caching "<session id>/tail/<tokens>".
    session, _, rest = request_id.partition("/")
    label = f"{session_tag(session)}/{rest}" if rest else session_tag(session)
    return label if sample_index == 0 else f"{label}#{sample_index}"


def view(snapshot: KVSnapshot, tier: KVTierStats | None = None) -> KVView:
    return KVView(
        block_size=snapshot.block_size,
        device="".join(SLOT_CHARS[s] for s in snapshot.device),
        cpu="".join(SLOT_CHARS[s] for s in snapshot.cpu),
        sequences=[
            SequenceView(
                label=_label(seq.request_id, seq.sample_index),
                status=seq.status,
                tokens=seq.num_tokens,
                computed=seq.num_computed_tokens,
                blocks=[f"{TIER_CHARS[tier]}{slot}" for tier, slot in seq.blocks],
            )
            for seq in snapshot.sequences
        ],
        num_sequences=snapshot.num_sequences,
        kv_tier=tier_stats(tier) if tier is not None else None,
    )
