"""The bounded inbox between paho's network thread and the handler threads.

Messages are sharded by topic onto worker threads, so messages on one topic are handled in the order
they arrived while different topics proceed in parallel. QoS 0 messages are never waited for: when a shard is
full they are dropped and counted, and so are those of a sender that already has half a shard's QoS 0 messages
waiting (its share, ``edgeswarm.shares``: one member flooding heartbeats or metrics cannot crowd out the others'
heartbeats and turn them suspect).

A QoS 1 message is never dropped, and acknowledged only once its handler ran: when its shard is full, ``put`` holds
the network thread (which stops reading the socket, so TCP pushes back on the broker) until there is room, for at
most ``hold_s``. Past that the message is handed back (``InboundMessage.redeliver``): its connection ends cleanly
and resumes its session, and the broker sends everything left unacknowledged again, in order. The broker's own
window (MQTT 5 ReceiveMaximum) cannot do this: Mosquitto 2.0 sends past it (docs/bus-rate.md).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable

from edgeswarm.bus.mqtt import InboundMessage
from edgeswarm.metrics import Metrics
from edgeswarm.shares import SharedLimit

log = logging.getLogger(__name__)

# Most messages a worker handles before it acknowledges them together (while more wait in its shard).
ACK_BATCH = 16


class _Shard:
    def __init__(self, name: str, capacity: int, handle: Callable[[InboundMessage], None], metrics: Metrics) -> None:
        self.capacity = capacity
        self._room = threading.Event()  # set by the worker when the network thread waits for room
        self._waiting = False
        # SimpleQueue: C-level put/get with the cheapest wake-up of a waiting thread (every request pays it).
        self._items: queue.SimpleQueue[tuple[InboundMessage, str | None] | None] = queue.SimpleQueue()
        # QoS 0 messages waiting, per sender. Only those: QoS 1 ones are bounded by the broker's send window, and
        # the data plane's hot path pays nothing for the bookkeeping.
        self._qos0 = SharedLimit(capacity, max(1, capacity // 2))
        self._handle = handle
        self._metrics = metrics
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def __len__(self) -> int:
        return self._items.qsize()

    def put(self, msg: InboundMessage, sender: str) -> bool:
        """Queue a QoS 0 message if it fits; False when it does not (never waits)."""
        # Only network threads put (one per broker connection), so the bound holds to within one each.
        if self._items.qsize() >= self.capacity or self._qos0.take(sender, 1) is not None:
            return False
        self._items.put((msg, sender))
        return True

    def put_held(self, msg: InboundMessage, hold_s: float) -> bool:
        """Queue a QoS 1 message, waiting up to ``hold_s`` seconds for room; False if there was none by then."""
        if self._items.qsize() >= self.capacity and not self._wait_for_room(hold_s):
            return False
        self._items.put((msg, None))
        return True

    def _wait_for_room(self, hold_s: float) -> bool:
        self._metrics.count("inbox_held")
        deadline = time.monotonic() + hold_s
        try:
            while self._items.qsize() >= self.capacity and not self.stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._room.clear()
                self._waiting = True
                if self._items.qsize() < self.capacity:
                    break
                # In slices: a wake-up the worker gave just before _waiting was set is not waited for long.
                self._room.wait(min(left, 0.05))
            return True
        finally:
            self._waiting = False

    def stop(self) -> None:
        self.stopped = True
        self._room.set()
        self._items.put(None)

    def _run(self) -> None:
        handled: list[InboundMessage] = []  # handled, not yet acknowledged
        while True:
            # Acknowledged in batches while more messages wait (one write for all), at once when none does: a
            # message is never acknowledged before its handler ran, nor held back while the worker idles.
            if handled and (len(handled) >= ACK_BATCH or self._items.empty()):
                InboundMessage.ack_together(handled)
                handled.clear()
            item = self._items.get()
            if item is None:
                InboundMessage.ack_together(handled)
                return
            msg, sender = item
            if self._waiting:
                self._room.set()
            if sender is not None:
                self._qos0.release(sender, 1)
            if self.stopped:  # shutting down: what is still queued is neither handled nor acknowledged
                continue
            if msg.superseded:  # its connection gave its messages back, and the broker sends this one again
                self._metrics.count("redelivery_skipped")
                continue
            try:
                self._handle(msg)
            except Exception:  # the handler is expected to catch everything; this is the last guard
                self._metrics.count("handler_errors")
                log.exception("unhandled error while handling a message on %s", msg.topic)
            finally:
                handled.append(msg)


class Inbox:
    """``workers`` shards, each drained by its own thread. ``sender_of`` names the sender of a message on a topic
    (default: the topic itself), whose QoS 0 messages may fill at most half a shard."""

    def __init__(self, name: str, workers: int, capacity: int, handle: Callable[[InboundMessage], None],
                 metrics: Metrics, on_drop: Callable[[InboundMessage, int], None],
                 sender_of: Callable[[str], str] | None = None, *, hold_s: float = 5.0,
                 on_held: Callable[[InboundMessage, int], None] | None = None) -> None:
        per_shard = max(16, capacity // workers)
        self._on_drop = on_drop
        self.hold_s = hold_s  # seconds a QoS 1 message may hold the network thread before it is handed back
        self._on_held = on_held
        self._metrics = metrics
        self._sender_of = sender_of or (lambda topic: topic)
        self._shard_of: dict[str, int] = {}  # topic -> its shard, remembered (only the network threads put)
        self._shards = [_Shard(f"{name}-worker-{i}", per_shard, handle, metrics) for i in range(workers)]

    def put(self, msg: InboundMessage) -> None:
        """Queue ``msg``. A QoS 0 message that does not fit is handed to ``on_drop`` (with the shard's depth), which
        counts, logs and answers it without blocking. A QoS 1 message waits for room up to ``hold_s`` seconds at a
        time; past that it is handed back for redelivery (``on_held`` is told, with the depth) or, where its
        connection cannot resume a session, waits on."""
        index = self._shard_of.get(msg.topic)
        if index is None:
            index = zlib.crc32(msg.topic.encode()) % len(self._shards)
            if len(msg.topic) <= 256:  # bounded, in entries and size: topics come from the broker, senders name them
                if len(self._shard_of) >= 4096:
                    self._shard_of.clear()
                self._shard_of[msg.topic] = index
        shard = self._shards[index]
        if msg.qos == 0:
            if not shard.put(msg, self._sender_of(msg.topic)):
                self._on_drop(msg, len(shard))
            return
        while not shard.put_held(msg, self.hold_s):
            if shard.stopped:
                return  # the service is stopping: neither handled nor acknowledged, like what is still queued
            if msg.redeliver():
                self._metrics.count("inbox_redelivered")
                if self._on_held is not None:
                    self._on_held(msg, len(shard))
                return

    @property
    def depth(self) -> int:
        return sum(len(s) for s in self._shards)

    @property
    def saturated(self) -> bool:
        """True when any shard is at or above its capacity."""
        return any(len(s) >= s.capacity for s in self._shards)

    def stop(self) -> None:
        for shard in self._shards:
            shard.stop()
        for shard in self._shards:
            shard.thread.join(timeout=5)
