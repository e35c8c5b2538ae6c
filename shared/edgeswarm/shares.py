"""Per-sender shares of a shared limit: one member that takes all it may still leaves the rest for the others.

A service that holds things on behalf of the members that send them (open checkpoint uploads, the bytes they
hold, queued requests) bounds them in all; without more, one member that sends as fast as it can fills that
bound and every other member is answered ``busy`` for as long as it keeps sending. A ``SharedLimit`` adds a
share: each sender may hold at most ``share`` of the ``capacity`` units, so whatever one sender does,
``capacity - share`` stay for the others. Senders are node ids: the bus checks that a message's sender is the node
its topic names, and on a secure cluster the broker's ACL binds that node to the client's credentials, so one
member cannot spread its load over other names.

Pure bookkeeping (no I/O, no clock), thread-safe. A sender is remembered only while it holds something, so the
table holds at most as many senders as units are held.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

LimitKind = Literal["share", "capacity"]


@dataclass(frozen=True)
class Refusal:
    """Why ``amount`` units could not be taken: the sender's own share is used up (``share``) or everybody's
    together (``capacity``). ``held`` is what was held at the time (the sender's or everybody's), ``limit`` the
    limit it hit."""

    kind: LimitKind
    sender: str
    amount: int
    held: int
    limit: int

    def describe(self, unit: str) -> str:
        """The refusal in words, ``unit`` naming what is counted (``"uploads open"``, ``"bytes"``)."""
        if self.kind == "share":
            return (f"{self.sender} already holds {self.held} {unit}, its share ({self.limit}, so one member cannot "
                    f"crowd out the others); this needs {self.amount} more")
        return f"all members together hold {self.held} {unit}, the limit ({self.limit}); this needs {self.amount} more"


def default_share(capacity: int, parts: int = 4) -> int:
    """The share of one sender when none is configured: a ``parts``-th of ``capacity``, at least 1."""
    return max(1, capacity // parts)


class SharedLimit:
    """``capacity`` units shared by senders, each holding at most ``share`` of them (a share above the capacity
    counts as the capacity). Amounts are non-negative integers in any unit (items, bytes)."""

    def __init__(self, capacity: int, share: int) -> None:
        if capacity < 1 or share < 1:
            raise ValueError(f"a shared limit needs a capacity and a share of at least 1, not {capacity} and {share}")
        self.capacity = capacity
        self.share = min(share, capacity)
        self._held: dict[str, int] = {}
        self._total = 0
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        """Units held by all senders together."""
        with self._lock:
            return self._total

    def held(self, sender: str) -> int:
        """Units ``sender`` holds."""
        with self._lock:
            return self._held.get(sender, 0)

    @property
    def senders(self) -> int:
        """How many senders hold something."""
        with self._lock:
            return len(self._held)

    def refusal(self, sender: str, amount: int) -> Refusal | None:
        """Why ``sender`` could not take ``amount`` more now, or None if it could (nothing is taken)."""
        with self._lock:
            return self._refusal(sender, amount)

    def take(self, sender: str, amount: int) -> Refusal | None:
        """Take ``amount`` units for ``sender``: None when taken, else why not (and nothing is taken)."""
        if amount < 0:
            raise ValueError(f"cannot take a negative amount ({amount})")
        with self._lock:
            why = self._refusal(sender, amount)
            if why is None and amount:
                self._held[sender] = self._held.get(sender, 0) + amount
                self._total += amount
            return why

    def release(self, sender: str, amount: int) -> None:
        """Give back ``amount`` units ``sender`` took (never more than it holds)."""
        if amount <= 0:
            return
        with self._lock:
            held = self._held.get(sender, 0)
            freed = min(held, amount)
            if held - freed:
                self._held[sender] = held - freed
            else:
                self._held.pop(sender, None)
            self._total -= freed

    def _refusal(self, sender: str, amount: int) -> Refusal | None:
        mine = self._held.get(sender, 0)
        if self.share < self.capacity and mine + amount > self.share:
            return Refusal("share", sender, amount, mine, self.share)
        if self._total + amount > self.capacity:
            return Refusal("capacity", sender, amount, self._total, self.capacity)
        return None


class QueueShares:
    """Each caller's share of a request queue: at most ``capacity // parts`` of its ``capacity`` requests and, with
    ``max_bytes``, ``max_bytes // parts`` of the bytes they hold (``parts`` 2: one caller leaves at least half)."""

    def __init__(self, capacity: int, max_bytes: int | None = None, parts: int = 2) -> None:
        self._requests = SharedLimit(capacity, default_share(capacity, parts))
        self._bytes = None if max_bytes is None else SharedLimit(max_bytes, default_share(max_bytes, parts))

    def take(self, caller: str, nbytes: int = 0) -> str | None:
        """Take a place for one request of ``caller`` holding ``nbytes``: None when taken, else why not, in words."""
        why = self._requests.take(caller, 1)
        if why is not None:
            return why.describe("requests waiting")
        if self._bytes is not None:
            full = self._bytes.take(caller, nbytes)
            if full is not None:
                self._requests.release(caller, 1)
                return full.describe("bytes of requests waiting")
        return None

    def release(self, caller: str, nbytes: int = 0) -> None:
        """Give back the place of one request of ``caller`` that held ``nbytes``."""
        self._requests.release(caller, 1)
        if self._bytes is not None:
            self._bytes.release(caller, nbytes)
