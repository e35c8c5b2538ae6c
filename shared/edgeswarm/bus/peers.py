"""The directory of peers: the latest retained status of every node's services."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from edgeswarm.errors import UnknownNodeError
from edgeswarm.membership import observed_at
from edgeswarm.messages import Status

if TYPE_CHECKING:
    from edgeswarm.bus.inbound import Inbound


class PeerDirectory:
    """Latest Status per (node, service), newest by when it was true. Thread-safe.

    A live status counts from its arrival (receiver's clock), a retained copy from its send time but never from
    the future: a status stamped years ahead would otherwise outrank every genuine one after it, and with its
    ``data_url`` redirect every tensor for that service for good.
    """

    def __init__(self) -> None:
        self._statuses: dict[tuple[str, str], tuple[float, Status]] = {}
        self._cv = threading.Condition()

    def update(self, inbound: Inbound) -> None:
        """Handler for ``edgeswarm/node/+/+/status``: keep the newest status of each service (the bus has checked
        that the sender is the node the topic and the status name)."""
        status = inbound.body
        if not isinstance(status, Status):
            return
        key = (status.node, status.service)
        at = observed_at(inbound.envelope.sent_at, inbound.retained, time.time())
        with self._cv:
            old = self._statuses.get(key)
            if old is None or old[0] <= at:
                self._statuses[key] = (at, status)
                self._cv.notify_all()

    def get(self, node: str, service: str) -> Status | None:
        """The newest status of ``service`` on ``node``, or None if never seen."""
        with self._cv:
            entry = self._statuses.get((node, service))
            return None if entry is None else entry[1]

    def wait_for(self, node: str, service: str, timeout_s: float) -> Status:
        """The status of ``service`` on ``node``, waiting up to ``timeout_s`` seconds for it to appear.

        Raises UnknownNodeError naming the nodes that are known.
        """
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while (node, service) not in self._statuses:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    known = sorted({n for n, _ in self._statuses})
                    raise UnknownNodeError(
                        f"no status from {service} on node {node!r} after {timeout_s:.1f} s; known nodes: {known}"
                    )
                self._cv.wait(remaining)
            return self._statuses[(node, service)][1]

    def all(self) -> list[Status]:
        """Every known status."""
        with self._cv:
            return [s for _, s in self._statuses.values()]
