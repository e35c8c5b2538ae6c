"""Sending a worker's tensors to one peer in order, on a thread of its own.

A device's network interface sends while its processor computes; so a worker hands each tensor (an activation,
a gradient, an AllReduce chunk, a unit's state) to the outbox of its destination and goes on computing, while the
emulated link (which holds the sender for the transfer time) paces the outbox. One outbox per peer lets links to
different peers carry traffic at the same time, as the planner's cost model assumes, and keeps the order of the
sends to one peer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from functools import partial

from edgeswarm.runtime.serial import SerialThread

log = logging.getLogger(__name__)

Send = Callable[[], object]
OnError = Callable[[Hashable, str], None]


class Outbox:
    """Runs the sends queued with ``put`` one after another (on a ``SerialThread``); a failed send is reported to
    ``on_error`` with the scope it belonged to (a round, say) and the reason, and the outbox goes on with the
    next."""

    def __init__(self, peer: str, on_error: OnError) -> None:
        self.peer = peer
        self._on_error = on_error
        self._sends = SerialThread(f"outbox-{peer}")

    def put(self, scope: Hashable, send: Send) -> None:
        """Queue ``send`` (a call that sends one tensor) for ``scope``; never blocks."""
        self._sends.submit(partial(self._send, scope, send))

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then end the thread (waiting at most ``timeout_s`` seconds)."""
        self._sends.close(timeout_s)

    def _send(self, scope: Hashable, send: Send) -> None:
        try:
            send()
        except Exception as exc:  # noqa: BLE001 - reported to the scope, which fails with it
            log.error("sending a tensor of %s to %s failed: %s", scope, self.peer, exc)
            self._on_error(scope, f"sending to {self.peer} failed: {exc}")
