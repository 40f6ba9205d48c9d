"""Connections the server closes for a client's doing, logged as counts, not one line each.

A client that holds or floods sockets makes the server close thousands of connections a second
(reset as accepted, pushed out, timed out: service/server/listener.py, http_guard.py). One line
each would be the attack's own log flood; `ConnectionLog` writes the first such close at once
and then one INFO line per `every_s` while they go on: how many of each kind, and the client
addresses that had the most. A quiet interval writes nothing.
"""

from __future__ import annotations

import asyncio
import collections
import logging

MAX_ADDRESSES = 1_000  # addresses counted per interval (the busiest are in the first ones)
SHOWN_ADDRESSES = 3


class ConnectionLog:
    def __init__(self, log: logging.Logger, every_s: float = 10.0) -> None:
        if every_s <= 0:
            raise ValueError("every_s must be > 0")
        self.log = log
        self.every_s = every_s
        self._kinds: collections.Counter[str] = collections.Counter()
        self._addresses: collections.Counter[str] = collections.Counter()
        self._timer: asyncio.TimerHandle | None = None

    def closed(self, kind: str, address: str) -> None:
        """One connection from `address` closed, for the reason `kind` ("reset as accepted:
        ..."), called on the event loop."""
        self._kinds[kind] += 1
        if address in self._addresses or len(self._addresses) < MAX_ADDRESSES:
            self._addresses[address] += 1
        if self._timer is None:  # the first after a quiet interval: at once
            self._write("")
            self._timer = asyncio.get_running_loop().call_later(self.every_s, self._interval_ended)

    def _interval_ended(self) -> None:
        self._timer = None
        if self._kinds:
            self._write(f" in the last {self.every_s:g} s")
            self._timer = asyncio.get_running_loop().call_later(self.every_s, self._interval_ended)

    def _write(self, when: str) -> None:
        kinds = "; ".join(f"{count:,} {kind}" for kind, count in self._kinds.most_common())
        addresses = ", ".join(
            f"{address} ({count:,})"
            for address, count in self._addresses.most_common(SHOWN_ADDRESSES)
        )
        more = len(self._addresses) - SHOWN_ADDRESSES
        if more > 0:
            addresses += f" and {more:,} more"
        self.log.info("connections closed%s: %s; from %s", when, kinds, addresses)
        self._kinds.clear()
        self._addresses.clear()

    def close(self) -> None:
        """Write what is counted and stop the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._kinds:
            self._write(" since the last line")
