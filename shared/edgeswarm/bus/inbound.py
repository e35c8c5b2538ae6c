"""What the bus hands its handlers: a decoded, validated message, or one exactly as it arrived. (Its own module so
that the bus's helpers, the peer directory among them, can name it without importing the bus.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from edgeswarm.wire import Envelope, Message, WireTensor


@dataclass(frozen=True)
class Inbound:
    """A decoded, validated message as handlers see it. ``tensor`` is set for tensor-carrying messages."""

    topic: str
    envelope: Envelope
    body: Message
    tensor: WireTensor | None
    retained: bool

    @property
    def sender(self) -> str:
        return f"{self.envelope.sender_node}/{self.envelope.sender_service}"


Handler = Callable[[Inbound], None]


@dataclass(frozen=True)
class RawInbound:
    """A message exactly as it arrived, not decoded or checked: for tools that show the traffic itself."""

    topic: str
    payload: bytes
    retained: bool
    qos: int


RawHandler = Callable[[RawInbound], None]
