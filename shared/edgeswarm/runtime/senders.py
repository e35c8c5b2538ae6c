"""The one check of who sent a data-plane message: every worker program and coordinator program applies it before
it uses a tensor, and counts a refusal the same way (``data_refused.sender``), so a stranger's tensor (a node the
job's plan does not name for that message) is dropped wherever it lands."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgeswarm.bus import Inbound
    from edgeswarm.metrics import Metrics

REFUSED_SENDER = "data_refused.sender"  # the counter every program's sender check increments


def stranger(msg: Inbound, allowed: str | Collection[str], what: str) -> str | None:
    """Why ``msg`` may not be used: its sender (the envelope's node, which the bus has checked against the topic)
    is not ``allowed`` (the node, or the nodes, the plan names for it); None when it is. ``what`` names the message
    for the reason."""
    sender = msg.envelope.sender_node
    ok = sender == allowed if isinstance(allowed, str) else sender in allowed
    if ok:
        return None
    expected = allowed if isinstance(allowed, str) else ", ".join(sorted(allowed)) or "no node"
    return f"{what} from {sender}: the plan expects it from {expected}"


def count_stranger(metrics: Metrics) -> None:
    """Count one message refused for its sender (``data_refused.sender``)."""
    metrics.count(REFUSED_SENDER)
