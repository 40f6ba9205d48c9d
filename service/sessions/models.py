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
    """The conversation's KV pages: where the next turn's prompt prefix comes from."""

    token_ids: list[int]
    block_size: int
    # Chain hashes of every full block of token_ids (service.engine.blocks.hash_blocks).
    block_hashes: list[int]
    # Per block, where it was when the page map was last written: "device", "cpu" or "none".
    tiers: list[str]
    namespace: str  # what the hashes cover besides tokens: model id and cache salt
    model_id: str
    replica: str  # the replica that wrote it (holds the pages, if anyone does)
    updated: float


class SessionMeta(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    created: float
    updated: float
    owner: str  # replica that served the latest turn
    model_id: str
    system: str | None  # None: the chat template's default system prompt
    turns: int
