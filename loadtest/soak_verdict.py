"""The soak's verdict: its rules on samples and Redis keys, pure functions (loadtest/soak.py
says what each check means and why its bounds are what they are)."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

SESSION_KEY = re.compile(r"session:([A-Za-z0-9_-]+)(?::(messages|pagemap|lease))?")
KEY_KINDS = ("meta", "messages", "pagemap", "lease")  # service/sessions/store.py's layout


@dataclass(slots=True, frozen=True)
class Flatness:
    warm: float  # median of the second quarter of the samples
    end: float  # median of the last quarter
    slope_per_h: float  # least-squares slope over the second half, per hour (for the record)

    @property
    def growth(self) -> float:
        return self.end / self.warm - 1.0


def flatness(times_s: list[float], values: list[float]) -> Flatness:
    """Quarter medians and the second half's slope of evenly spaced samples (8 at least)."""
    n = len(values)
    if n != len(times_s) or n < 8:
        raise ValueError(f"need 8 samples or more to judge flatness, got {n}")
    q = n // 4
    half_t, half_v = times_s[n // 2 :], values[n // 2 :]
    mean_t, mean_v = statistics.fmean(half_t), statistics.fmean(half_v)
    var_t = sum((t - mean_t) ** 2 for t in half_t)
    cov = sum((t - mean_t) * (v - mean_v) for t, v in zip(half_t, half_v, strict=True))
    return Flatness(
        warm=statistics.median(values[q : 2 * q]),
        end=statistics.median(values[n - q :]),
        slope_per_h=3600.0 * cov / var_t if var_t > 0 else 0.0,
    )


@dataclass(slots=True, frozen=True)
class SessionMeta:
    turns: int
    system: bool  # opened with a system prompt (the `shared` scenario)


@dataclass(slots=True)
class KeyAccount:
    keys: int = 0
    by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KEY_KINDS, 0))
    sessions_with_turns: int = 0
    sessions_with_system: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def sessions(self) -> int:
        return self.by_kind["meta"]


def account_keys(
    prefix: str, ttls: Mapping[str, int], metas: Mapping[str, SessionMeta]
) -> KeyAccount:
    """Every key under `prefix` (with its TTL in seconds) checked against the sessions' metadata
    (by session id) on an idle server; what does not fit the store's layout is listed in
    `problems`. Idle, no turn is in flight, so a turn lease left is one its turn did not end."""
    account = KeyAccount(keys=len(ttls))
    present: dict[str, set[str]] = {}
    for key, ttl in sorted(ttls.items()):
        match = SESSION_KEY.fullmatch(key.removeprefix(prefix)) if key.startswith(prefix) else None
        if match is None:
            account.problems.append(f"{key}: not a session key")
            continue
        session_id, kind = match.group(1), match.group(2) or "meta"
        account.by_kind[kind] += 1
        present.setdefault(session_id, set()).add(kind)
        if ttl <= 0:
            account.problems.append(f"{key}: no TTL")
        if kind == "lease":
            account.problems.append(f"{key}: a turn lease with no turn in flight")
    for session_id, kinds in present.items():
        meta = metas.get(session_id) if "meta" in kinds else None
        if meta is None:
            account.problems.append(f"session {session_id}: {sorted(kinds)} without metadata")
            continue
        account.sessions_with_turns += meta.turns > 0
        account.sessions_with_system += meta.system
        # A turn writes its messages and its page map together; a session opened has neither.
        if kinds - {"meta", "lease"} != ({"messages", "pagemap"} if meta.turns > 0 else set()):
            account.problems.append(f"session {session_id}: {meta.turns} turns, {sorted(kinds)}")
    return account


@dataclass(slots=True)
class Check:
    name: str
    ok: bool | None  # None: not checked (`detail` says why)
    detail: str

    def line(self) -> str:
        mark = {True: "PASS", False: "FAIL", None: "skip"}[self.ok]
        return f"{mark}  {self.name}: {self.detail}"


def check_rss(times_s: list[float], rss_mb: list[float], bound: float) -> Check:
    if len(rss_mb) < 8 or any(math.isnan(v) for v in rss_mb):
        return Check("rss flat", None, f"{len(rss_mb)} RSS samples under load (8 needed)")
    f = flatness(times_s, rss_mb)
    detail = (
        f"{f.warm:.0f} MB after warm-up -> {f.end:.0f} MB at the end ({f.growth:+.1%}, bound "
        f"+{bound:.0%}); second-half slope {f.slope_per_h:+.0f} MB/h"
    )
    return Check("rss flat", f.growth <= bound, detail)


def check_keys(account: KeyAccount, opens: int | None, users: int) -> Check:
    """No problem with the keys and, given Locust's successful opens, the sessions number them
    (plus at most one a user whose open the stop timeout cut off)."""
    kinds = ", ".join(f"{k} {n}" for k, n in account.by_kind.items())
    detail = (
        f"{account.keys} keys ({kinds}); {account.sessions} sessions, "
        f"{account.sessions_with_turns} with turns, {account.sessions_with_system} with a "
        f"system prompt; {len(account.problems)} problems {account.problems[:5]}"
    )
    ok = not account.problems
    if opens is not None:
        detail += f"; Locust opened {opens}"
        ok = ok and opens <= account.sessions <= opens + users
    return Check("redis keys", ok, detail)
