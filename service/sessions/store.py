"""The session store: the only code that talks to Redis.

Keys, all under one prefix and all expiring `ttl_s` after the latest activity:
  {prefix}session:{id}            hash: created, updated, owner, model_id, turns, system,
                                  secret_sha256
  {prefix}session:{id}:messages   list: one msgpack-encoded `Message` per entry
  {prefix}session:{id}:pagemap    string: the msgpack-encoded `PageMap`

NOTE (atomicity): a turn's messages and its page map are written in one MULTI/EXEC, so a
reader never sees a conversation whose token ids and text disagree.
NOTE (secrets): only a SHA-256 of the secret is stored. Secrets are 256 random bits, so a
plain hash is enough (no key stretching); comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import cast

import msgspec
import redis.asyncio as aioredis

from service.sessions.models import Message, PageMap, SessionMeta

_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")


class SessionNotFound(LookupError):
    """No such session: never created, expired, or a malformed id."""


class WrongSecret(PermissionError):
    """The session exists but the secret does not match."""


@dataclass(slots=True, frozen=True)
class NewSession:
    meta: SessionMeta
    secret: str  # returned to the client once, never stored


def _sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class SessionStore:
    def __init__(self, redis: aioredis.Redis, *, prefix: str, ttl_s: int, replica: str) -> None:
        if ttl_s < 1:
            raise ValueError("ttl_s must be >= 1")
        self._redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.replica = replica
        self._encode = msgspec.msgpack.Encoder().encode
        self._message = msgspec.msgpack.Decoder(Message)
        self._page_map = msgspec.msgpack.Decoder(PageMap)

    # ------------------------------------------------------------------ keys

    def meta_key(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}"

    def messages_key(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}:messages"

    def page_map_key(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}:pagemap"

    def _keys(self, session_id: str) -> tuple[str, str, str]:
        return (
            self.meta_key(session_id),
            self.messages_key(session_id),
            self.page_map_key(session_id),
        )

    # ------------------------------------------------------------------ sessions

    async def create(self, *, model_id: str, system: str | None) -> NewSession:
        session_id = secrets.token_urlsafe(16)
        secret = secrets.token_urlsafe(32)
        now = time.time()
        fields: dict[str, str | int | float] = {
            "created": now,
            "updated": now,
            "owner": self.replica,
            "model_id": model_id,
            "turns": 0,
            "secret_sha256": _sha256(secret),
        }
        if system is not None:
            fields["system"] = system
        key = self.meta_key(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
            pipe.expire(key, self.ttl_s)
            await pipe.execute()
        meta = SessionMeta(
            session_id=session_id,
            created=now,
            updated=now,
            owner=self.replica,
            model_id=model_id,
            system=system,
            turns=0,
        )
        return NewSession(meta, secret)

    async def authenticate(self, session_id: str, secret: str) -> SessionMeta:
        """The session's metadata if `secret` opens it; refreshes its TTL."""
        fields = await self._load_meta_fields(session_id)
        if not hmac.compare_digest(fields.get("secret_sha256", ""), _sha256(secret)):
            raise WrongSecret(f"wrong secret for session {session_id}")
        await self.touch(session_id)
        return _meta(session_id, fields)

    async def load(self, session_id: str) -> tuple[SessionMeta, PageMap | None]:
        """Metadata and page map for the next turn, in one round trip; refreshes the TTL."""
        _check_id(session_id)
        meta_key, messages_key, page_map_key = self._keys(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(meta_key)
            pipe.get(page_map_key)
            for key in (meta_key, messages_key, page_map_key):
                pipe.expire(key, self.ttl_s)
            raw_meta, raw_page_map, *_ = await pipe.execute()
        fields = _decode_fields(raw_meta)
        if "secret_sha256" not in fields:
            raise SessionNotFound(f"unknown or expired session {session_id}")
        page_map = None if raw_page_map is None else self._page_map.decode(raw_page_map)
        return _meta(session_id, fields), page_map

    async def messages(self, session_id: str) -> list[Message]:
        raw = cast(list[bytes], await self._redis.lrange(self.messages_key(session_id), 0, -1))
        return [self._message.decode(item) for item in raw]

    async def append_turn(
        self, session_id: str, messages: list[Message], page_map: PageMap
    ) -> None:
        """Add a turn's messages and replace the page map, atomically; refreshes the TTL."""
        meta_key, messages_key, page_map_key = self._keys(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.rpush(messages_key, *(self._encode(m) for m in messages))
            pipe.set(page_map_key, self._encode(page_map))
            pipe.hset(meta_key, mapping={"updated": time.time(), "owner": self.replica})
            pipe.hincrby(meta_key, "turns", 1)
            for key in (meta_key, messages_key, page_map_key):
                pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def touch(self, session_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            for key in self._keys(session_id):
                pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()

    # ------------------------------------------------------------------ internals

    async def _load_meta_fields(self, session_id: str) -> dict[str, str]:
        _check_id(session_id)
        raw = cast(dict[bytes, bytes], await self._redis.hgetall(self.meta_key(session_id)))
        fields = _decode_fields(raw)
        if "secret_sha256" not in fields:
            raise SessionNotFound(f"unknown or expired session {session_id}")
        return fields


def _check_id(session_id: str) -> None:
    if not _SESSION_ID.fullmatch(session_id):
        raise SessionNotFound("malformed session id")


def _decode_fields(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


def _meta(session_id: str, fields: dict[str, str]) -> SessionMeta:
    return SessionMeta(
        session_id=session_id,
        created=float(fields["created"]),
        updated=float(fields["updated"]),
        owner=fields["owner"],
        model_id=fields["model_id"],
        system=fields.get("system"),
        turns=int(fields["turns"]),
    )
