"""The bounded inbox between paho's network thread and the handler threads.

Messages are sharded by topic onto worker threads, so messages on one topic are handled in the order
they arrived while different topics proceed in parallel. ``put`` never blocks: when a shard is full,
QoS 0 messages are dropped and counted, and so are those of a sender that already has half a shard's QoS 0
messages waiting (its share, ``edgeswarm.shares``: one member flooding heartbeats or metrics cannot crowd out the
others' heartbeats and turn them suspect). QoS 1 messages are bounded by the broker's send window
(MQTT 5 ReceiveMaximum, and acknowledgements wait until the handler has finished), so they only
overflow the hard limit of twice the capacity if the broker ignores that window.
"""

from __future__ import annotations

import logging
import queue
import threading
import zlib
from collections.abc import Callable

from edgeswarm.bus.mqtt import InboundMessage
from edgeswarm.metrics import Metrics
from edgeswarm.shares import SharedLimit

log = logging.getLogger(__name__)


class _Shard:
    def __init__(self, name: str, capacity: int, handle: Callable[[InboundMessage], None], metrics: Metrics) -> None:
        self.capacity = capacity
        # SimpleQueue: C-level put/get with the cheapest wake-up of a waiting thread (every request pays it).
        self._items: queue.SimpleQueue[tuple[InboundMessage, str | None] | None] = queue.SimpleQueue()
        # QoS 0 messages waiting, per sender. Only those: QoS 1 ones are bounded by the broker's send window, and
        # the data plane's hot path pays nothing for the bookkeeping.
        self._qos0 = SharedLimit(capacity, max(1, capacity // 2))
        self._handle = handle
        self._metrics = metrics
        self._stopped = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def __len__(self) -> int:
        return self._items.qsize()

    def put(self, msg: InboundMessage, sender: str) -> bool:
        # Only network threads put (one per broker connection), so the bound holds to within one each.
        depth = self._items.qsize()
        if msg.qos == 0:
            if depth >= self.capacity or self._qos0.take(sender, 1) is not None:
                return False
            self._items.put((msg, sender))
            return True
        if depth >= 2 * self.capacity:
            return False
        self._items.put((msg, None))
        return True

    def stop(self) -> None:
        self._stopped = True
        self._items.put(None)

    def _run(self) -> None:
        while True:
            item = self._items.get()
            if item is None:
                return
            msg, sender = item
            if sender is not None:
                self._qos0.release(sender, 1)
            if self._stopped:  # shutting down: what is still queued is acknowledged, not handled
                msg.ack()
                continue
            try:
                self._handle(msg)
            except Exception:  # the handler is expected to catch everything; this is the last guard
                self._metrics.count("handler_errors")
                log.exception("unhandled error while handling a message on %s", msg.topic)
            finally:
                msg.ack()


class Inbox:
    """``workers`` shards, each drained by its own thread. ``sender_of`` names the sender of a message on a topic
    (default: the topic itself), whose QoS 0 messages may fill at most half a shard."""

    def __init__(self, name: str, workers: int, capacity: int, handle: Callable[[InboundMessage], None],
                 metrics: Metrics, on_drop: Callable[[InboundMessage, int], None],
                 sender_of: Callable[[str], str] | None = None) -> None:
        per_shard = max(16, capacity // workers)
        self._on_drop = on_drop
        self._sender_of = sender_of or (lambda topic: topic)
        self._shard_of: dict[str, int] = {}  # topic -> its shard, remembered (only the network threads put)
        self._shards = [_Shard(f"{name}-worker-{i}", per_shard, handle, metrics) for i in range(workers)]

    def put(self, msg: InboundMessage) -> None:
        """Queue ``msg`` without blocking; a message that does not fit is acknowledged and handed to ``on_drop``
        (with the shard's depth), which counts, logs and answers it without blocking."""
        index = self._shard_of.get(msg.topic)
        if index is None:
            index = zlib.crc32(msg.topic.encode()) % len(self._shards)
            if len(msg.topic) <= 256:  # bounded, in entries and size: topics come from the broker, senders name them
                if len(self._shard_of) >= 4096:
                    self._shard_of.clear()
                self._shard_of[msg.topic] = index
        shard = self._shards[index]
        if not shard.put(msg, self._sender_of(msg.topic) if msg.qos == 0 else ""):
            try:
                self._on_drop(msg, len(shard))
            finally:
                msg.ack()

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
