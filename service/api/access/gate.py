"""Who may come in: API keys naming tenants, the Origin rule for browsers' WebSockets, and a
limiter that slows the guessing of keys and session secrets (docs/protocol.md, "Access").

Keys file (`--api-keys-file`): one key a line, `KEY TENANT [admin]`, fields apart by
whitespace; blank lines and lines starting with `#` are skipped. KEY is at least 16
characters, or `sha256:` and the key's SHA-256 in hex (so the file need not hold the key);
TENANT is 1..64 of `A-Z a-z 0-9 _ . -`; `admin` opens /v1/stats and /v1/kv too.
Without a keys file everyone is the tenant "default", with every right, as before keys.

NOTE (keys): only SHA-256 digests are held, and a key is compared with every digest in
constant time, so the time taken says nothing about which key, or how much of one, matched.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import re
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from starlette.datastructures import Headers
from starlette.requests import HTTPConnection

from service.api.access.limiter import AttemptLimiter
from service.api.refusal import Refusal, RefusalReason

DEFAULT_TENANT = "default"
MIN_KEY_CHARS = 16
_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_DIGEST = re.compile(r"sha256:([0-9a-fA-F]{64})")


@dataclass(slots=True, frozen=True)
class Principal:
    """Whom a key speaks for."""

    tenant: str
    admin: bool


OPEN = Principal(DEFAULT_TENANT, admin=True)  # everyone, when keys are off


# ---------------------------------------------------------------------- the keys file


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message names the file and the line."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, digests: dict[bytes, Principal]) -> None:
        if not digests:
            raise ValueError("no API keys")
        self._digests = list(digests.items())

    def __len__(self) -> int:
        return len(self._digests)

    @classmethod
    def load(cls, path: Path) -> ApiKeys:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise KeysFileError(f"{path}: cannot read the API keys file: {exc}") from None
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, source: str) -> ApiKeys:
        digests: dict[bytes, Principal] = {}
        lines: dict[bytes, int] = {}  # where each key was first given
        for number, line in enumerate(text.splitlines(), start=1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            try:
                digest, principal = _entry(fields)
                if digest in lines:
                    raise ValueError(f"the same key as line {lines[digest]}")
            except ValueError as exc:
                raise KeysFileError(f"{source}:{number}: {exc}") from None
            lines[digest] = number
            digests[digest] = principal
        if not digests:
            raise KeysFileError(f"{source}: no API keys in the file")
        return cls(digests)

    def lookup(self, key: str) -> Principal | None:
        digest = _digest(key)
        found = None
        for known, principal in self._digests:  # every one, whatever matches: see NOTE (keys)
            if hmac.compare_digest(known, digest):
                found = principal
        return found


def _entry(fields: list[str]) -> tuple[bytes, Principal]:
    """One line's key digest and principal; ValueError saying what is wrong (never the key)."""
    if len(fields) not in (2, 3):
        raise ValueError(f"expected `KEY TENANT [admin]`, got {len(fields)} fields")
    key, tenant, *flag = fields
    if flag and flag != ["admin"]:
        raise ValueError(f"the third field may only be `admin`, not {flag[0]!r}")
    if not _TENANT.fullmatch(tenant):
        raise ValueError(f"tenant {tenant!r} is not 1..64 of A-Z a-z 0-9 _ . -")
    if match := _DIGEST.fullmatch(key):
        return bytes.fromhex(match.group(1)), Principal(tenant, admin=bool(flag))
    if key.startswith("sha256:"):
        raise ValueError("a `sha256:` key needs 64 hex digits after the colon")
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"the key has {len(key)} characters; at least {MIN_KEY_CHARS}")
    return _digest(key), Principal(tenant, admin=bool(flag))


# ---------------------------------------------------------------------- the gate


def bearer(headers: Headers) -> str | None:
    """The key of an `Authorization: Bearer KEY` header."""
    scheme, _, key = headers.get("authorization", "").partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def client_address(connection: HTTPConnection) -> str:
    """The client's address: the peer, or, from a `--trusted-proxies` peer, the last address
    before the trusted ones in X-Forwarded-For (uvicorn's proxy headers, set up by
    service.server.serve from the same option)."""
    return connection.client.host if connection.client is not None else "unknown"


class ResumeAttempt:
    """One resume's standing with the limiter: per client address and per session."""

    def __init__(self, gate: Gate, address: str, tenant: str, session_id: str) -> None:
        self._gate = gate
        self._address = address
        self._session = f"{tenant}/{session_id}"  # ids are per tenant

    def check(self) -> None:
        """Refusal(too_many_attempts) while the address or the session is refused."""
        self._gate.check(self._address, self._session)

    def failed(self) -> None:
        """A wrong secret, or an unknown session (so probing ids is slowed too)."""
        self._gate.addresses.fail(self._address)
        self._gate.sessions.fail(self._session)

    def succeeded(self) -> None:
        # NOTE: the address keeps its count: a client must not wipe its failures by opening
        # a session of its own between guesses.
        self._gate.sessions.forget(self._session)


class Gate:
    def __init__(
        self,
        keys: ApiKeys | None,
        *,
        allowed_origins: tuple[str, ...] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keys = keys
        self.allowed_origins = frozenset(allowed_origins)  # normalized (ServerConfig)
        self.addresses = AttemptLimiter(clock=clock)
        self.sessions = AttemptLimiter(clock=clock)

    @classmethod
    def load(cls, api_keys_file: Path | None, allowed_origins: tuple[str, ...]) -> Gate:
        """The gate of a keys file (None: keys off) and the allowed origins; KeysFileError for
        an unusable keys file."""
        keys = ApiKeys.load(api_keys_file) if api_keys_file is not None else None
        return cls(keys, allowed_origins=allowed_origins)

    def check(self, address: str, session: str | None = None) -> None:
        waits = [self.addresses.retry_after(address)]
        if session is not None:
            waits.append(self.sessions.retry_after(session))
        wait = max((w for w in waits if w is not None), default=None)
        if wait is not None:
            raise Refusal(
                RefusalReason.TOO_MANY_ATTEMPTS,
                f"too many failed attempts; retry in {math.ceil(wait)} s",
                retry_after_s=round(wait, 3),
            )

    def authenticate(self, key: str | None, address: str) -> Principal:
        """Whom `key` speaks for; Refusal (unauthorized, too_many_attempts) if no one.

        A wrong key counts against the address; a missing one does not (it guesses nothing).
        """
        if self.keys is None:
            return OPEN
        self.check(address)
        if key is None:
            raise Refusal(
                RefusalReason.UNAUTHORIZED,
                "this server needs an API key: `Authorization: Bearer KEY`, or `api_key` in "
                "open/resume",
            )
        principal = self.keys.lookup(key)
        if principal is None:
            self.addresses.fail(address)
            raise Refusal(RefusalReason.UNAUTHORIZED, "the API key is not valid")
        return principal

    def resume_attempt(self, address: str, tenant: str, session_id: str) -> ResumeAttempt:
        attempt = ResumeAttempt(self, address, tenant, session_id)
        attempt.check()
        return attempt

    def origin_allowed(self, headers: Headers) -> bool:
        """May a WebSocket handshake with these headers go on? Yes without `Origin` (not a
        browser), for the allowed origins, and for the server's own origin (`Origin`'s
        host:port is `Host`) where that host is an IP address or `localhost`; no for any
        other, "null" included.

        NOTE (DNS rebinding): a page at http://evil.example:8000 whose name the attacker
        points at this server's address sends `Origin` and `Host` alike, so their equality
        alone proves nothing; only a host no DNS answer stands behind does. A server reached
        by name lists that origin in `allowed_origins`."""
        origin = headers.get("origin")
        if origin is None or "*" in self.allowed_origins:
            return True
        try:
            origin = normalize_origin(origin)
        except ValueError:
            return False
        if origin in self.allowed_origins:
            return True
        scheme = origin.partition("://")[0]
        try:  # the Host header as an origin of the same scheme, default port left out
            own = normalize_origin(f"{scheme}://{headers.get('host', '')}")
        except ValueError:
            return False
        return origin == own and _named_by_no_dns(urllib.parse.urlsplit(own).hostname or "")


def _named_by_no_dns(host: str) -> bool:
    """An IP address, or localhost: a host name no DNS answer can point elsewhere."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def cache_salt_for(tenant: str, cache_salt: str | None = None) -> str:
    """The prefix-cache salt of a tenant's requests (CacheScope.salt): tenants never share a
    block, and neither do requests of one tenant with different `cache_salt`s. The default
    tenant without a salt keeps "", so its hashes are those stored before tenants existed."""
    if tenant == DEFAULT_TENANT and cache_salt is None:
        return ""
    return f"tenant:{len(tenant)}:{tenant}|salt:{cache_salt or ''}"


def normalize_origin(origin: str) -> str:
    """`origin` as browsers send it in `Origin`: `scheme://host[:port]` in lower case, the
    scheme's default port left out. ValueError for anything else (a path, "null")."""
    try:
        parts = urllib.parse.urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        parts, port = None, None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        raise ValueError(f"not an origin (http[s]://host[:port]): {origin!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    default = 80 if parts.scheme == "http" else 443
    return f"{parts.scheme}://{host}" + ("" if port in (None, default) else f":{port}")
