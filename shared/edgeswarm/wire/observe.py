"""Messages as a person reads them: the decoded schema and fields of a payload, tensors as their dtype and shape.

``edgeswarm watch`` shows the traffic through this, with the project's own codec (``decode``), so what it shows is
what every service accepts. A tensor sent in chunks is shown once, when its last chunk has arrived; no tensor
bytes are kept, only which chunks of each transfer were seen.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.errors import ExpiredMessageError, WireError
from edgeswarm.wire.codec import DEFAULT_MAX_TENSOR_BYTES, Frame, decode

# Messages and chunk transfers remembered, to show each message once however often the broker delivers it (once
# per matching subscription, and again after a QoS 1 redelivery).
_REMEMBER = 8192
_OPEN_TRANSFERS = 1024


class TensorSummary(BaseModel):
    """A tensor as watched: its wire dtype, shape, size in bytes and the chunks it travelled in."""

    model_config = ConfigDict(frozen=True)

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: int


class Observation(BaseModel):
    """One message as ``edgeswarm watch`` shows it. ``time`` is when it was received and ``sent_at`` when it was
    sent (Unix seconds); ``error`` is set, and the decoded parts are not, for a payload the codec refused."""

    model_config = ConfigDict(frozen=True, populate_by_name=True)

    topic: str
    schema_name: str | None = Field(default=None, serialization_alias="schema")
    version: int | None = None
    sender: str | None = None
    msg_id: str | None = None
    fields: dict[str, Any] = Field(default_factory=dict)
    tensor: TensorSummary | None = None
    retained: bool = False
    time: float
    sent_at: float | None = None
    expired: bool = False
    error: str | None = None


def plain(value: Any) -> Any:
    """``value`` (a dumped message body) with bytes replaced by ``<N bytes>`` and tuples by lists, so it prints as
    JSON and never as raw bytes."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    return value


class Observer:
    """Turns raw payloads into Observations: one per message, one per whole tensor, None for the rest.

    Not thread-safe: feed it from one thread (``edgeswarm watch`` uses a single inbox worker).
    """

    def __init__(self, *, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES, clock: Callable[[], float] = time.time,
                 remember: int = _REMEMBER, open_transfers: int = _OPEN_TRANSFERS) -> None:
        self._max_tensor_bytes = max_tensor_bytes
        self._clock = clock
        self._remember = remember
        self._open_transfers = open_transfers
        self._seen: OrderedDict[tuple[str, str, int], None] = OrderedDict()
        self._chunks: OrderedDict[tuple[str, str], set[int]] = OrderedDict()

    def observe(self, topic: str, payload: bytes, retained: bool = False) -> Observation | None:
        """The Observation of one payload received on ``topic``; None for a message already shown, and for a
        tensor chunk that does not complete its tensor. Never raises for what the payload holds."""
        now = self._clock()
        if not payload:
            return Observation(topic=topic, retained=retained, time=now,
                               error="<empty: a retained message cleared>")
        expired = False
        try:
            try:
                frame = decode(payload, max_tensor_bytes=self._max_tensor_bytes)
            except ExpiredMessageError:
                # Still worth showing (late traffic is what one watches for): decoded as of the epoch, flagged.
                frame = decode(payload, max_tensor_bytes=self._max_tensor_bytes, now=0.0)
                expired = True
        except WireError as exc:
            return Observation(topic=topic, retained=retained, time=now,
                               error=f"<undecodable: {len(payload)} bytes: {exc}>")
        env = frame.envelope
        chunk = -1 if frame.tensor is None else frame.tensor.chunk
        if self._already_seen((env.sender_instance, env.msg_id, chunk)):
            return None
        tensor = None
        if frame.tensor is not None:
            tensor = self._completed(frame)
            if tensor is None:
                return None
        return Observation(
            topic=topic, schema_name=env.schema_name, version=env.schema_version,
            sender=f"{env.sender_node}/{env.sender_service}", msg_id=env.msg_id, fields=plain(frame.body.model_dump()),
            tensor=tensor, retained=retained, time=now, sent_at=env.sent_at, expired=expired)

    def _already_seen(self, key: tuple[str, str, int]) -> bool:
        if key in self._seen:
            return True
        self._seen[key] = None
        if len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        return False

    def _completed(self, frame: Frame) -> TensorSummary | None:
        """The tensor's summary once every chunk of its transfer was seen, else None (the chunk is counted)."""
        desc = frame.tensor
        assert desc is not None
        key = (frame.envelope.sender_instance, frame.envelope.msg_id)
        seen = self._chunks.setdefault(key, set())
        seen.add(desc.chunk)
        if len(self._chunks) > self._open_transfers:  # transfers that never completed (a watch started mid-way)
            self._chunks.popitem(last=False)
        if len(seen) < desc.n_chunks:
            return None
        self._chunks.pop(key, None)
        return TensorSummary(dtype=desc.dtype, shape=desc.shape, nbytes=desc.nbytes, chunks=desc.n_chunks)
