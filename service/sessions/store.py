"""The session store: the only code that talks to Redis.

Keys, all under one prefix; the first three expire `ttl_s` after the latest activity:
  {prefix}session:{id}            hash: created, updated, owner, model_id, turns, system,
                                  secret_sha256, last_write (the latest turn's write id)
  {prefix}session:{id}:messages   list: one msgpack-encoded `Message` per entry
  {prefix}session:{id}:pagemap    string: the msgpack-encoded `PageMap`
  {prefix}session:{id}:lease      string: the holder of the turn lease; expires `lease_s`
                                  after it was taken or renewed

NOTE (atomicity): a turn's messages, its page map and the turn count are written by one Lua
script, so a reader never sees a conversation whose token ids and text disagree.
NOTE (fencing): a turn runs under a lease. `begin_turn` sets the lease key to a holder token
unique to this turn (unless another holder has it) with an expiry, and records the session's
turn count as the fencing index; `append_turn` writes only while the lease key still holds
that token and the count has not moved, and otherwise writes nothing. The lease alone keeps
two replicas from answering one session at once while processes keep time; the check at
write time keeps the history whole when they do not: a replica paused past its lease (a
stalled event loop, a partition) finds that another holder took over, and cannot overwrite
the newer turn or fork the history. Read the page map (`load`) after `begin_turn`: the lease
fences the state read under it, not a state read before.
NOTE (retries): a Sentinel client retries a command whose connection failed, even one that
ran and lost its reply (service/sessions/redis_server.py), so every write here is
idempotent: `create` writes the same fields again, `begin_turn` sets the same holder,
`renew_turn` and `end_turn` compare the holder, and `append_turn` records a write id that a
retry of the same write finds and stops at.
NOTE (secrets): only a SHA-256 of the secret is stored. Secrets are 256 random bits, so a
plain hash is enough (no key stretching); comparison is constant-time.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from service.sessions.models import Message, PageMap, SessionMeta

log = logging.getLogger(__name__)

_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")

LEASE_S = 10.0  # a turn lease's length; the holder renews it well within that while it answers

# KEYS: meta, lease. ARGV: holder, lease ms. -> {1, turns} | {0, ""} no session | {-1, holder}
_BEGIN_TURN = """
if redis.call('HEXISTS', KEYS[1], 'secret_sha256') == 0 then return {0, ''} end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then return {-1, holder} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return {1, redis.call('HGET', KEYS[1], 'turns')}
"""
# KEYS: lease. ARGV: holder, lease ms. -> 1 renewed | 0 not ours
_RENEW_TURN = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
# KEYS: lease. ARGV: holder. -> 1 released | 0 not ours
_END_TURN = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""
# KEYS: meta, messages, page map, lease. ARGV: holder, turn, write id, ttl s, updated, owner,
# page map, message... -> 1 written (now or by an earlier try) | 0 lease lost | -1 turn moved
_APPEND_TURN = """
if redis.call('HGET', KEYS[1], 'last_write') == ARGV[3] then return 1 end
if redis.call('GET', KEYS[4]) ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[1], 'turns') ~= ARGV[2] then return -1 end
redis.call('RPUSH', KEYS[2], unpack(ARGV, 8))
redis.call('SET', KEYS[3], ARGV[7])
redis.call('HSET', KEYS[1], 'updated', ARGV[5], 'owner', ARGV[6], 'last_write', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'turns', 1)
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return 1
"""


class SessionNotFound(LookupError):
    """No such session: never created, expired, or a malformed id."""


class WrongSecret(PermissionError):
    """The session exists but the secret does not match."""


class SessionBusy(Exception):
    """Another holder (this replica or another) has the session's turn lease."""


class LeaseLost(Exception):
    """A turn's write was refused, and nothing written: its lease expired or the turn moved on."""


@dataclass(slots=True, frozen=True)
class TurnLease:
    session_id: str
    holder: str  # the replica id and a random token: unique per lease
    turn: int  # the session's turn count when the lease was taken: the fencing index


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
        self._begin_turn = redis.register_script(_BEGIN_TURN)
        self._renew_turn = redis.register_script(_RENEW_TURN)
        self._end_turn = redis.register_script(_END_TURN)
        self._append_turn = redis.register_script(_APPEND_TURN)
        # Releases of leases whose begin_turn failed after sending (`_release_when_back`).
        self._releasing: set[asyncio.Task[None]] = set()

    def under(self, prefix: str) -> SessionStore:
        """Another key space (a tenant's) over the same Redis client; close only this one."""
        return SessionStore(self._redis, prefix=prefix, ttl_s=self.ttl_s, replica=self.replica)

    # ------------------------------------------------------------------ keys

    def meta_key(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}"

    def messages_key(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}:messages"

    def page_map_key(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}:pagemap"

    def lease_key(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}:lease"

    def response_key(self, response_id: str) -> str:
        return f"{self.prefix}response:{response_id}"

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
        return _meta(session_id, fields), self._decode_page_map(session_id, raw_page_map)

    def _decode_page_map(self, session_id: str, raw: bytes | None) -> PageMap | None:
        """None where there is none, or where it is not a record this version reads (another
        version's, during a rolling update): the turn then renders the stored messages, as
        for another model's page map, and recomputes; the next turn stores a readable one."""
        if raw is None:
            return None
        try:
            return self._page_map.decode(raw)
        except msgspec.MsgspecError as exc:
            log.warning(
                "the page map of session %s is unreadable (%s); rebuilt from text", session_id, exc
            )
            return None

    async def messages(self, session_id: str) -> list[Message]:
        raw = cast(list[bytes], await self._redis.lrange(self.messages_key(session_id), 0, -1))
        return [self._message.decode(item) for item in raw]

    # ------------------------------------------------------------------ turns

    async def begin_turn(self, session_id: str, *, lease_s: float = LEASE_S) -> TurnLease:
        """Take the session's turn lease for `lease_s`; then `load` what the turn builds on."""
        _check_id(session_id)
        holder = f"{self.replica}:{secrets.token_urlsafe(12)}"
        keys = [self.meta_key(session_id), self.lease_key(session_id)]
        try:
            status, value = cast(
                list[Any], await self._begin_turn(keys=keys, args=[holder, _ms(lease_s)])
            )
        except BaseException:
            # A stalled Redis (a timeout or cancellation around this call) may still run the
            # script once it answers: a lease nobody holds would answer `busy` till it expired.
            self._release_when_back(keys[1], holder, lease_s, taken=False)
            raise
        if status == 0:
            raise SessionNotFound(f"unknown or expired session {session_id}")
        if status < 0:
            raise SessionBusy(f"session {session_id} is answering on {value.decode()}")
        return TurnLease(session_id=session_id, holder=holder, turn=int(value))

    async def renew_turn(self, lease: TurnLease, *, lease_s: float = LEASE_S) -> None:
        """Extend the lease to `lease_s` from now, if it is still ours."""
        keys = [self.lease_key(lease.session_id)]
        if not await self._renew_turn(keys=keys, args=[lease.holder, _ms(lease_s)]):
            raise LeaseLost(f"the turn lease on session {lease.session_id} expired")

    async def append_turn(
        self, lease: TurnLease, messages: list[Message], page_map: PageMap
    ) -> None:
        """Add a turn's messages and replace the page map, atomically, if `lease` still holds
        and no turn was written since it was taken; refreshes the TTL."""
        await self._write_turn(lease, secrets.token_urlsafe(12), messages, page_map)

    async def end_turn(self, lease: TurnLease, *, lease_s: float = LEASE_S) -> None:
        """Release the lease, if it is still ours (an expired one may be someone else's). If
        Redis cannot be reached (a stall, an outage), the release is retried in the
        background until it is through or the lease has expired, so that the session is not
        `busy` with nobody answering; the error is raised all the same."""
        key = self.lease_key(lease.session_id)
        try:
            await self._end_turn(keys=[key], args=[lease.holder])
        except BaseException:
            self._release_when_back(key, lease.holder, lease_s, taken=True)
            raise

    # ------------------------------------------------------------------ upkeep

    # ------------------------------------------------------------------ stored responses

    async def save_response(self, response_id: str, record: bytes) -> None:
        """A Responses API answer kept for `previous_response_id` and GET, for the sessions'
        TTL (service/api/openai/responses.py says what the record holds)."""
        await self._redis.set(self.response_key(response_id), record, ex=self.ttl_s)

    async def load_response(self, response_id: str) -> bytes | None:
        return cast("bytes | None", await self._redis.get(self.response_key(response_id)))

    async def delete_response(self, response_id: str) -> bool:
        return bool(await self._redis.delete(self.response_key(response_id)))

    async def touch(self, session_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            for key in self._keys(session_id):
                pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def ping(self) -> None:
        """Redis answers (start-up: a server that refuses writes for now still starts)."""
        await self._redis.ping()

    async def check_writes(self) -> None:
        """A write Redis must accept (a short-lived key of this replica's), what /health
        asks: a server that answers but refuses writes (`min-replicas-to-write` with no
        replica in sync, a read-only replica after a failover) fails it as one that does not
        answer."""
        key = f"{self.prefix}health:{self.replica}"
        await self._redis.set(key, str(time.time()), px=10_000)

    async def settle(self) -> None:
        """Wait for the releases of leases whose turns failed to start (tests, shutdown)."""
        await asyncio.gather(*self._releasing, return_exceptions=True)

    async def close(self) -> None:
        for task in self._releasing:
            task.cancel()
        await self._redis.aclose()

    # ------------------------------------------------------------------ internals

    def _release_when_back(
        self, lease_key: str, holder: str, lease_s: float, *, taken: bool
    ) -> None:
        try:
            task = asyncio.get_running_loop().create_task(
                self._release_stale(lease_key, holder, lease_s, taken),
                name=f"release {lease_key}",
            )
        except RuntimeError:  # no running loop (shutting down): the lease expires by itself
            return
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release_stale(
        self, lease_key: str, holder: str, lease_s: float, taken: bool
    ) -> None:
        """Release `holder`'s lease by its token (never anyone else's) as soon as Redis takes
        commands again, for as long as the lease could last. `taken`: the lease was ours, so
        one answer ends it; else the script that takes it may not have run yet, and a "not
        ours" means try again."""
        deadline = time.monotonic() + lease_s
        delay = 0.05
        while time.monotonic() < deadline:
            try:
                if await self._end_turn(keys=[lease_key], args=[holder]) or taken:
                    log.info("released %s after Redis came back", lease_key)
                    return
            except (RedisError, OSError):
                pass  # still away: try again
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    async def _write_turn(
        self, lease: TurnLease, write_id: str, messages: list[Message], page_map: PageMap
    ) -> None:
        """One try of `append_turn`: a retry with the same `write_id` does not write twice."""
        if not messages:
            raise ValueError("a turn adds at least one message")
        keys = [*self._keys(lease.session_id), self.lease_key(lease.session_id)]
        args: list[bytes | str | int | float] = [
            *(lease.holder, lease.turn, write_id, self.ttl_s, time.time(), self.replica),
            self._encode(page_map),
            *(self._encode(m) for m in messages),
        ]
        status = await self._append_turn(keys=keys, args=args)
        if status == 0:
            raise LeaseLost(f"the turn lease on session {lease.session_id} expired or moved")
        if status < 0:
            raise LeaseLost(f"session {lease.session_id} moved past turn {lease.turn}")

    async def _load_meta_fields(self, session_id: str) -> dict[str, str]:
        _check_id(session_id)
        raw = cast(dict[bytes, bytes], await self._redis.hgetall(self.meta_key(session_id)))
        fields = _decode_fields(raw)
        if "secret_sha256" not in fields:
            raise SessionNotFound(f"unknown or expired session {session_id}")
        return fields


def _ms(seconds: float) -> int:
    if seconds <= 0:
        raise ValueError("a lease lasts > 0 s")
    return max(1, round(seconds * 1000))


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
