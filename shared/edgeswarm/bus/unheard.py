"""Messages to an inbox that the broker heard no one for: held, and sent again once the inbox's subscriber is back.

An MQTT 5 broker acknowledges a QoS 1 message that matched no subscription with reason code 16 ("no matching
subscribers") and drops it. On a service's inbox (its requests, its tensors, an instance's replies) that happens
when the subscriber is between connections: after a broker restart, Mosquitto 2.0 keeps no session begun with a
clean start, so each subscriber subscribes again once it has reconnected, and a publisher that reconnected first
has what it queued meanwhile acknowledged as heard by no one. A tensor lost so stalls its round until the peer wait
runs out (and the round is replayed). An inbox has its subscriber back within seconds, or its owner is declared
lost; so the connection hands such a message here (``unheard``), and the resender sends the topic's oldest held
message again after a pause that doubles from PROBE_FIRST_S to PROBE_MAX_S, one at a time; once one is heard
(``heard``), the rest of the topic's follow at once. A message held past its give-up time, or beyond MAX_HELD_BYTES
held in all (the oldest first), is dropped with a warning: its receiver is gone.

``send`` is called from the resender's own thread, never from the caller's: ``unheard`` and ``heard`` are called on
the connection's network thread, which must not wait for room in the send window it alone frees.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the connection imports this module
    from edgeswarm.bus.mqtt import PublishOptions

log = logging.getLogger(__name__)

NO_MATCHING_SUBSCRIBERS = 16  # the MQTT 5 PUBACK reason code
PROBE_FIRST_S = 0.05
PROBE_MAX_S = 1.0
MAX_HELD_BYTES = 256 * 1024 * 1024


@dataclass
class Unheard:
    """One QoS 1 message to an inbox, as published, and the monotonic time after which it is given up. ``probe``: sent
    again alone, to learn whether the subscriber is back."""

    topic: str
    payload: bytes
    retain: bool
    options: PublishOptions | None
    give_up_at: float
    probe: bool = False


@dataclass
class _Topic:
    held: deque[Unheard] = field(default_factory=deque)
    probing: bool = False  # a probe is out: wait for its acknowledgement
    flush: bool = False  # the subscriber is back: send everything held
    pause: float = PROBE_FIRST_S
    due: float = 0.0


class UnheardResender:
    """Holds unheard messages per topic and sends them again (see the module's docstring). ``send(msg)`` publishes
    ``msg`` again through the connection (which hands it back to ``unheard`` if it is still heard by no one);
    ``label`` names the connection in warnings."""

    def __init__(self, send: Callable[[Unheard], None], *, label: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self._label = label
        self._clock = clock
        self._changed = threading.Condition()
        self._topics: dict[str, _Topic] = {}
        self._held_bytes = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self.resent = 0
        self.dropped = 0

    @property
    def held(self) -> int:
        """Messages held now."""
        with self._changed:
            return sum(len(t.held) for t in self._topics.values())

    def unheard(self, msg: Unheard) -> None:
        """The broker heard no one for ``msg``: hold it (a probe goes back to the front, its pause doubled)."""
        with self._changed:
            if self._closed:
                return
            topic = self._topics.setdefault(msg.topic, _Topic())
            now = self._clock()
            if msg.probe:
                topic.probing = False
                topic.pause = min(PROBE_MAX_S, topic.pause * 2)
                topic.held.appendleft(msg)
                topic.due = now + topic.pause
            else:
                topic.held.append(msg)
                if len(topic.held) == 1 and not topic.probing and not topic.flush:
                    # The first one held: its pause starts now (later ones wait behind it, not push it back).
                    topic.due = now + topic.pause
            self._held_bytes += len(msg.payload)
            self._trim()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mqtt-unheard", daemon=True)
                self._thread.start()
            self._changed.notify()

    def heard(self, topic_name: str) -> None:
        """A probe on ``topic_name`` was heard: the rest held for it go out now."""
        with self._changed:
            topic = self._topics.get(topic_name)
            if topic is None:
                return
            topic.probing, topic.flush, topic.pause = False, True, PROBE_FIRST_S
            self._changed.notify()

    def close(self) -> None:
        """Drop everything held and end the thread."""
        with self._changed:
            self._closed = True
            self._topics.clear()
            self._held_bytes = 0
            self._changed.notify()

    def _trim(self) -> None:
        while self._held_bytes > MAX_HELD_BYTES:
            oldest = min((t for t in self._topics.values() if t.held), key=lambda t: t.held[0].give_up_at)
            self._drop(oldest.held.popleft(), "more than MAX_HELD_BYTES held")

    def _drop(self, msg: Unheard, why: str) -> None:
        self._held_bytes -= len(msg.payload)
        self.dropped += 1
        log.warning("%s: dropped a message to %s that no subscriber heard (%s)", self._label, msg.topic[:256], why)

    def _due(self, now: float) -> tuple[list[Unheard], float | None]:
        """With the lock held: what to send now, and when the next topic is due (None: nothing waits)."""
        out: list[Unheard] = []
        nearest: float | None = None
        for name in list(self._topics):
            topic = self._topics[name]
            while topic.held and topic.held[0].give_up_at <= now:
                self._drop(topic.held.popleft(), "its receiver stayed unsubscribed")
            if not topic.held:
                if not topic.probing:
                    del self._topics[name]
                continue
            if topic.flush:
                for msg in topic.held:
                    msg.probe = False
                out.extend(topic.held)
                topic.held.clear()
                topic.flush = False
            elif not topic.probing and topic.due <= now:
                msg = topic.held.popleft()
                msg.probe, topic.probing = True, True
                out.append(msg)
            elif not topic.probing:
                nearest = topic.due if nearest is None else min(nearest, topic.due)
        for msg in out:
            self._held_bytes -= len(msg.payload)
        return out, nearest

    def _run(self) -> None:
        while True:
            with self._changed:
                while True:
                    if self._closed:
                        return
                    out, nearest = self._due(self._clock())
                    if out:
                        break
                    self._changed.wait(None if nearest is None else max(0.0, nearest - self._clock()))
            for msg in out:
                self.resent += 1
                try:
                    self._send(msg)
                except Exception:  # noqa: BLE001 - not sent (connection closing, window full): held again
                    log.debug("%s: could not send a held message to %s again", self._label, msg.topic[:256],
                              exc_info=True)
                    self.unheard(msg)
