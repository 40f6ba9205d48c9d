"""What Redis keeps per session, as msgspec Structs.

NOTE: `PageMap.token_ids` are the conversation's ids exactly as the model saw them (prompts,
generated tokens, end-of-turn tokens) and become the next turn's prompt prefix. Never
re-tokenize `Message.content` to rebuild them: the same text need not give the same ids, and a
different id sequence misses the prefix cache.
"""

from __future__ import annotations

import enum

import msgspec


class Role(enum.StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


class Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One entry of the conversation, as shown to clients on resume."""

    role: Role
    content: str
    created: float  # unix time
    # Assistant messages: why the answer ended (stop, length, cancelled, shutdown, disconnected).
    finish_reason: str | None = None


class PageMap(msgspec.Struct, kw_only=True):
    """The conversation's KV pages: the next turn's prompt prefix, and what its KV blocks are
    found under.

    NOTE (no per-block tiers): what a user resuming a session needs is the conversation as the
    model saw it: the next prompt is `token_ids` plus the new message, and the engine that
    serves it finds whatever blocks of it survive by their hashes, in its pools or in the
    third KV tier, and says in the turn's usage where the prompt came from (cached, swapped
    in, loaded, recomputed), truthfully, at that moment. Where each block was when the turn
    was stored is stale by the time the user comes back (evicted, swapped, saved to the third
    tier, or another replica answers), so it is not kept: no `tiers`, and no `block_hashes`
    (the engine computes them from the ids, the namespace and the cache scope) nor `replica`
    (the session's `owner`, written in the same script).
    NOTE (records written before): those carried `block_hashes`, `tiers` and `replica`;
    decoding skips fields the Struct does not name (msgspec's default: never set
    forbid_unknown_fields here), so they still load (tests/sessions/test_page_map.py).
    """

    token_ids: list[int]
    block_size: int  # tokens per block of the engine that wrote it
    # What block hashes covered besides tokens: model id and cache salt. A replica with
    # another salt (or block size) misses these blocks and computes them again.
    namespace: str
    model_id: str  # the ids are this model's: another model's page map is not used
    updated: float


class SessionMeta(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    created: float
    updated: float
    owner: str  # replica that served the latest turn
    model_id: str
    system: str | None  # None: the chat template's default system prompt
    turns: int
