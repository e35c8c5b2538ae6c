"""The bus: typed publish/subscribe, request/response and data-plane tensor transfers over MQTT.

Control traffic goes to the hub broker. A tensor for node X goes to the data-plane broker X advertises
in its retained status, through a pool of connections, so it crosses the network once (DESIGN.md
principle 3). Handlers run on the inbox's worker threads; a handler that raises is logged and counted
and the bus goes on. Every rejected payload is logged (rate-limited) with its topic and sender and counted
under ``rejected.<reason>`` in the metrics; a rejected or dropped request that names a valid reply topic of
its sender is answered with a RequestRejected (rate-limited), so its sender learns why at once.

Topics name their writer (``edgeswarm.topics``): the bus appends this node to the addresses it publishes to,
and drops any message whose ``sender_node`` is not the node its topic names (``rejected.forged_sender``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

from edgeswarm import topics
from edgeswarm.bus.inbound import Handler, Inbound, RawHandler, RawInbound
from edgeswarm.bus.inbox import Inbox
from edgeswarm.bus.mqtt import InboundMessage, MqttConnection, PublishOptions, TopicRouter, Will
from edgeswarm.bus.peers import PeerDirectory
from edgeswarm.bus.shaping import LINK_BURST_BYTES, ShapedLink
from edgeswarm.errors import (
    ExpiredMessageError,
    NotAuthorizedError,
    PeerOfflineError,
    RequestRejectedError,
    RequestTimeoutError,
    WireError,
)
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages import RequestRejected, Status
from edgeswarm.metrics import Metrics
from edgeswarm.queue_worker import QueueWorker
from edgeswarm.settings import Settings, parse_broker_url
from edgeswarm.wire import Envelope, Message, Reassembler, Sender, decode, encode, tensor_frames
from edgeswarm.wire.codec import peek_envelope
from edgeswarm.wire.schema import new_id

log = logging.getLogger(__name__)

# Room left in a packet for the frame header, topic and MQTT 5 properties beyond the encoded body.
_CHUNK_HEADROOM = 1024
# Longest ``stop`` waits for what was sent to leave (seconds): a 64 MiB tensor clears loopback in a fraction of it.
STOP_DRAIN_S = 3.0


def mirrored(env: Envelope, ttl_s: float | None, *, summary: bool = True) -> PublishOptions:
    """The MQTT 5 properties that mirror ``env`` (docs/wire-format.md section 3); without ``summary``, no
    ``edgeswarm`` user property (tensor frames: the wire format's version 2)."""
    return PublishOptions(
        expires_in_s=ttl_s, reply_to=env.reply_to, correlation_id=env.correlation_id,
        envelope=f"msg_id={env.msg_id} schema={env.schema_name}/{env.schema_version} "
                 f"sender={env.sender_node}/{env.sender_service}/{env.sender_instance}" if summary else None)


def _writer_of(topic: str) -> tuple[str | None, bool]:
    """``topic``'s writer and whether a node owns it: a service sees the same few topics over and over, and
    parsing them again for every message cost a microsecond each. Only short topics are remembered, so what the
    table holds stays small whatever topics arrive."""
    if len(topic) > _REMEMBERED_TOPIC_CHARS:
        return _parse_writer(topic)
    return _remembered_writer(topic)


def _parse_writer(topic: str) -> tuple[str | None, bool]:
    return topics.writer_of(topic), topics.owner_of(topic) is not None


_REMEMBERED_TOPIC_CHARS = 256
_remembered_writer = lru_cache(maxsize=4096)(_parse_writer)


def _sender_of(topic: str) -> str:
    """Whose share of the inbox a message on ``topic`` takes: the node the topic names as its writer, else the
    topic (a role's topic: the cluster view, a job's state)."""
    return _writer_of(topic)[0] or topic


def check_writer(topic: str, envelope: Envelope, body: Message) -> None:
    """Raise WireError (``forged_sender``) unless ``envelope``'s sender is the node ``topic`` names as its writer,
    and on a node's own topics a body that names a node (a Status, a profile report) names that node too."""
    writer, owned = _writer_of(topic)
    if writer is None:
        return
    if envelope.sender_node != writer:
        raise WireError(f"{envelope.schema_name} on {topic[:256]} says it is from {envelope.sender_node}, but only "
                        f"{writer} may write there", reason="forged_sender")
    if not owned:
        return
    named = getattr(body, "node", writer)
    if named != writer:
        raise WireError(f"{envelope.schema_name} on {topic[:256]} from {writer} speaks for node {named!s:.64}",
                        reason="forged_sender")


def raise_if_rejected(reply: Inbound, what: str) -> None:
    """Raise RequestRejectedError if ``reply`` says the request ``what`` was refused by the receiving bus."""
    body = reply.body
    if isinstance(body, RequestRejected):
        raise RequestRejectedError(f"{reply.sender} refused {what} ({body.reason}): {body.detail}",
                                   reason=body.reason)


@dataclass(frozen=True)
class _Route:
    handler: Handler
    schemas: tuple[type[Message], ...] | None


class Expectation:
    """A reply this instance is waiting for, matched by ``correlation_id`` on its reply topic."""

    def __init__(self, bus: Bus, correlation_id: str) -> None:
        self.correlation_id = correlation_id
        self._bus = bus
        self._event = threading.Event()
        self._reply: Inbound | None = None
        self.refusal: str | None = None  # why the broker refused to carry the request, if it did

    @property
    def arrived(self) -> bool:
        """Whether the reply is in (``wait`` then returns it at once)."""
        return self._event.is_set()

    def arrives_within(self, timeout_s: float) -> bool:
        """Whether the reply is in within ``timeout_s`` seconds; the expectation stays open."""
        return self._event.wait(timeout_s)

    def wait(self, timeout_s: float) -> Inbound | None:
        """The reply, or None if none arrived within ``timeout_s`` seconds. Ends the expectation."""
        try:
            self._event.wait(timeout_s)
            return self._reply
        finally:
            self._bus._forget(self.correlation_id)

    def _resolve(self, reply: Inbound) -> None:
        self._reply = reply
        self._event.set()

    def _refuse(self, why: str) -> None:
        self.refusal = why
        self._event.set()


class ReplyStream(Expectation):
    """Every reply to one request, in arrival order (a streamed answer: its parts, then its end), until ``close``.
    At most ``MAX_STREAM_BACKLOG`` replies wait to be taken; a sender that outruns its reader loses the newest
    (counted as ``stream_replies_dropped``)."""

    MAX_STREAM_BACKLOG = 4096

    def __init__(self, bus: Bus, correlation_id: str) -> None:
        super().__init__(bus, correlation_id)
        self._replies: deque[Inbound] = deque()
        self._ready = threading.Condition()

    def _resolve(self, reply: Inbound) -> None:
        with self._ready:
            if len(self._replies) >= self.MAX_STREAM_BACKLOG:
                self._bus.metrics.count("stream_replies_dropped")
                return
            self._replies.append(reply)
            self._ready.notify_all()
        self._event.set()

    def _refuse(self, why: str) -> None:
        with self._ready:
            self.refusal = why
            self._ready.notify_all()
        self._event.set()

    def next(self, timeout_s: float) -> Inbound | None:
        """The next reply, or None when none came within ``timeout_s`` seconds (or the broker refused the request:
        ``refusal`` says why). The stream stays open."""
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while not self._replies and self.refusal is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._ready.wait(left)
            return self._replies.popleft() if self._replies else None

    def close(self) -> None:
        """Stop taking replies (later ones are counted as late)."""
        self._bus._forget(self.correlation_id)


class _TokenBucket:
    """Allows ``rate`` events per second on average and ``burst`` at once. Thread-safe."""

    def __init__(self, rate: float, burst: int) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def take(self) -> bool:
        now = time.monotonic()
        with self._lock:
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
            self._at = now
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True


# Rejection answers: at most this many per second (bursts of twice as many) and this many waiting to be sent.
_REJECTION_RATE = 20.0
_REJECTION_QUEUE = 64


@dataclass(frozen=True)
class _Rejection:
    reply_to: str
    correlation_id: str
    reason: str
    detail: str


class Bus:
    """Connections, routing and transfers of one service instance.

    ``will`` (optional) is the message the broker publishes, retained, on ``will_topic`` if this
    process dies without disconnecting.
    """

    def __init__(self, settings: Settings, sender: Sender, metrics: Metrics | None = None, *,
                 will: Message | None = None, will_topic: str | None = None) -> None:
        self.settings = settings
        self.sender = sender
        self.metrics = metrics or Metrics()
        self.peers = PeerDirectory()
        self.reply_topic = topics.reply(sender.node, sender.service, sender.instance)
        self._reply_prefix = self.reply_topic + "/"
        self._routes = TopicRouter()
        self._raw_routes = TopicRouter()
        self._pending: dict[str, Expectation] = {}
        self._request_mids: OrderedDict[int, str] = OrderedDict()  # hub packet id -> correlation id of a request
        self._pending_lock = threading.Lock()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._seen_lock = threading.Lock()
        self._reject_log = RateLimitedLog(log, what="rejections")
        self._rejection_tokens = _TokenBucket(_REJECTION_RATE, int(2 * _REJECTION_RATE))
        self._rejections: QueueWorker[_Rejection] = QueueWorker("bus-rejections", _REJECTION_QUEUE,
                                                                self._answer_rejection, self.metrics)
        self._reconnect_hooks: list[Callable[[], None]] = []
        self._links = {peer: ShapedLink(peer, spec, burst_bytes=min(LINK_BURST_BYTES, settings.chunk_bytes))
                       for peer, spec in settings.links.items()}
        self.credentials = settings.credentials()
        self._reassembler = Reassembler(max_pending_bytes=settings.max_reassembly_bytes,
                                        max_sender_bytes=settings.max_reassembly_bytes_per_sender,
                                        timeout_s=settings.reassembly_timeout_s)
        self._timeouts_counted = 0
        self._inbox = Inbox(sender.service, settings.workers, settings.inbox_capacity, self._handle_raw, self.metrics,
                            on_drop=self._on_dropped, sender_of=_sender_of,
                            hold_s=min(settings.inbox_hold_s, settings.keepalive_s / 2), on_held=self._on_held)
        self._pool: dict[str, MqttConnection] = {}
        self._conn_by_url: dict[str, MqttConnection] = {}  # URLs as given -> their pooled connection
        self._pool_lock = threading.Lock()
        self._stop = threading.Event()
        self._housekeeper: threading.Thread | None = None
        will_spec = None
        if will is not None and will_topic is not None:
            will_spec = Will(will_topic, encode(sender.envelope(will), will))
        self.hub = self._make_connection(settings.hub_url, "hub", will_spec, self._on_hub_connected)
        data_url = parse_broker_url(settings.data_connect_plane_url).url
        self.data = self.hub if data_url == self.hub.url else self._make_connection(data_url, "data", None, None)
        self._pool[self.hub.url] = self.hub
        self._pool[self.data.url] = self.data
        # Peers on this node advertise the same outside address as this bus: tensors for them go through the
        # connection this node's services already hold, not out and back in through the host's published port.
        self._pool.setdefault(parse_broker_url(settings.data_plane_url).url, self.data)

    # --- lifecycle ----------------------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> None:
        """Connect to the hub (and the node's data broker), subscribe to replies and peer statuses."""
        self.hub.connect(timeout_s)
        if self.data is not self.hub:
            self.data.connect(timeout_s)
        # QoS 0 on the subscriber side: with clean sessions a lost connection loses the reply either
        # way (the request times out), and it spares an acknowledgement on every round trip.
        self.subscribe(self.reply_topic, self._resolve_reply, qos=0)
        self.subscribe(topics.ALL_STATUS, self.peers.update, schemas=(Status,))
        self._housekeeper = threading.Thread(target=self._housekeeping, name="bus-housekeeping", daemon=True)
        self._housekeeper.start()

    def stop(self, drain_s: float = STOP_DRAIN_S) -> None:
        """Disconnect every connection cleanly and stop the worker threads, once what was sent has left: up to
        ``drain_s`` seconds in all for messages in an emulated link's latency to go out and for the brokers to
        acknowledge the QoS 1 messages handed to them. paho's loop_stop does not wait, so a command that sent and
        stopped at once lost the tail of what it sent."""
        deadline = time.monotonic() + drain_s
        self._stop.set()
        for link in self._links.values():
            link.close(drain_s=max(0.0, deadline - time.monotonic()))
        with self._pool_lock:
            conns = list({id(c): c for c in self._pool.values()}.values())
        for conn in conns:
            conn.flush(max(0.0, deadline - time.monotonic()))
            conn.close()
        self._inbox.stop()
        self._rejections.stop()
        # Joined, so nothing of this bus logs after stop() returned (a test's captured stream is closed by then).
        if self._housekeeper is not None and self._housekeeper is not threading.current_thread():
            self._housekeeper.join(timeout=5.0)

    @property
    def network_alive(self) -> bool:
        """False once the network thread of any broker connection has died: this bus then receives nothing."""
        with self._pool_lock:
            conns = list(self._pool.values())
        return all(conn.network_alive for conn in conns)

    def on_reconnect(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` (on a fresh thread) after every reconnect to the hub, e.g. to republish state."""
        self._reconnect_hooks.append(hook)

    # --- publish / subscribe ------------------------------------------------------------------------

    def subscribe(self, topic_filter: str, handler: Handler, *, schemas: tuple[type[Message], ...] | None = None,
                  qos: int = 1, plane: str = "hub") -> None:
        """Call ``handler`` for each message on ``topic_filter`` whose body is one of ``schemas`` (None: any).

        ``plane`` is ``hub`` for control topics or ``data`` for this node's data-plane broker. An address
        (``topics.request``, ``topics.data``, ``topics.reply``) subscribes to what every sender sends to it.
        """
        if topics.is_address(topic_filter):
            topic_filter = topics.from_sender(topic_filter, "+")
        self._routes.add(topic_filter, _Route(handler, schemas))
        (self.data if plane == "data" else self.hub).subscribe(topic_filter, qos)

    def subscribe_raw(self, topic_filter: str, handler: RawHandler, *, qos: int = 1, plane: str = "hub") -> None:
        """Call ``handler`` with every message on ``topic_filter`` as it arrived (topic, payload bytes, retain flag),
        before any decoding or check: ``edgeswarm watch`` shows what is on the wire, the undecodable included.

        It runs where typed handlers run (an inbox worker; the network thread for this instance's own replies), so
        it must not block for long. An exception it raises is logged and counted (``handler_errors``) and the bus
        goes on. A message that also matches a ``subscribe`` filter is decoded and handled for that as usual; one
        that matches only raw filters is never decoded here. The broker may deliver a message once per matching
        subscription, so a handler whose filter overlaps another may see it twice.
        """
        self._raw_routes.add(topic_filter, handler)
        (self.data if plane == "data" else self.hub).subscribe(topic_filter, qos)

    def publish(self, topic: str, message: Message, *, qos: int = 1, retain: bool = False,
                ttl_s: float | None = None, correlation_id: str | None = None, reply_to: str | None = None,
                timeout_s: float | None = None) -> Envelope:
        """Publish ``message`` on the hub; returns the envelope sent. ``ttl_s`` sets its expiry (seconds). An
        address (``topics.request(node, service)``, say) is published to as this node."""
        inbox = topics.is_address(topic)
        if inbox:
            topic = topics.from_sender(topic, self.sender.node)
        env = self.sender.envelope(message, ttl_s=ttl_s, correlation_id=correlation_id, reply_to=reply_to)
        payload = encode(env, message)
        options = mirrored(env, ttl_s)
        mid = self.hub.publish(topic, payload, qos=qos, retain=retain, options=options,
                               timeout_s=timeout_s or self.settings.publish_timeout_s, inbox=inbox)
        if correlation_id is not None and reply_to == self.reply_topic and mid:
            with self._pending_lock:
                self._request_mids[mid] = correlation_id
                while len(self._request_mids) > 1024:
                    self._request_mids.popitem(last=False)
            why = self.hub.refusal(mid)  # the broker may have refused it before it was recorded
            if why is not None:
                self._on_refused(mid, why)
        self.metrics.count("messages_out")
        self.metrics.count("bytes_out", len(payload))
        return env

    def expect(self) -> Expectation:
        """Register interest in a reply carrying a fresh correlation id (for replies sent later)."""
        exp = Expectation(self, new_id())
        with self._pending_lock:
            self._pending[exp.correlation_id] = exp
        return exp

    def expect_stream(self) -> ReplyStream:
        """Register interest in every reply carrying a fresh correlation id, until the stream is closed."""
        stream = ReplyStream(self, new_id())
        with self._pending_lock:
            self._pending[stream.correlation_id] = stream
        return stream

    def request(self, topic: str, message: Message, *, timeout_s: float | None = None) -> Inbound:
        """Publish a request and wait for its reply. Raises RequestTimeoutError after ``timeout_s`` seconds."""
        timeout = timeout_s or self.settings.request_timeout_s
        exp = self.expect()
        try:
            self.publish(topic, message, ttl_s=timeout, correlation_id=exp.correlation_id,
                         reply_to=self.reply_topic, timeout_s=timeout)
        except Exception:
            self._forget(exp.correlation_id)
            raise
        reply = exp.wait(timeout)
        if exp.refusal is not None:
            raise NotAuthorizedError(
                f"the broker refused {message.SCHEMA} on {topic} ({exp.refusal}): this node "
                f"({self.sender.node}) may not send it there; `edgeswarm topics` says who may write what")
        if reply is None:
            raise RequestTimeoutError(
                f"no reply to {message.SCHEMA} on {topic} within {timeout:.1f} s; "
                "is the service it is addressed to running? (`edgeswarm status`)"
            )
        raise_if_rejected(reply, message.SCHEMA)
        return reply

    def _forget(self, correlation_id: str) -> None:
        with self._pending_lock:
            self._pending.pop(correlation_id, None)

    def reply(self, request: Inbound, message: Message) -> None:
        """Answer ``request`` on its ``reply_to`` topic with its correlation id."""
        target = self._reply_target(request)
        if target is not None:
            reply_to, correlation_id, ttl = target
            self.publish(reply_to, message, correlation_id=correlation_id, ttl_s=ttl)

    def _reply_target(self, request: Inbound) -> tuple[str, str, float | None] | None:
        """Where and how to answer ``request``: its reply address, the correlation id and the seconds the answer
        lives (as long as the request had left). None, counted and logged, when it names no reply topic of the
        requester's own node: a reply never goes to a job state, say."""
        env = request.envelope
        if not env.reply_to:
            self.metrics.count("rejected.no_reply_to")
            self._reject_log.warning("no_reply_to", "cannot answer %s from %s: it has no reply_to", env.schema_name,
                                     request.sender)
            return None
        if topics.reply_owner(env.reply_to) != env.sender_node:
            self.metrics.count("rejected.bad_reply_to")
            self._reject_log.warning("bad_reply_to", "not answering %s from %s: reply_to %r is not a reply topic of "
                                     "its node", env.schema_name, request.sender, env.reply_to[:256])
            return None
        ttl = None if env.expires_at is None else max(1.0, env.expires_at - time.time())
        return env.reply_to, env.correlation_id or env.msg_id, ttl

    # --- data plane ---------------------------------------------------------------------------------

    def send_tensor(self, node: str, service: str, message: Message, value: Any, *,
                    timeout_s: float | None = None, peer_wait_s: float | None = None,
                    expectation: Expectation | None = None, qos: int = 1) -> int:
        """Send ``value`` (numpy or torch) with ``message`` to ``service`` on ``node``; returns bytes sent.

        The frames go to the data-plane broker the receiver advertises, in chunks that fit that
        broker's maximum packet size, through this node's emulated link to ``node`` if one is set.
        ``peer_wait_s`` is how long to wait for the receiver's status to be known (default: the request
        timeout); answers to a peer pass 0, so an unknown sender never holds the answering thread.
        With ``expectation`` (from ``expect``) the tensor is a request: its envelope carries this instance's
        reply topic and the expectation's correlation id, and the answer resolves the expectation.
        ``qos`` is the frames' MQTT QoS: 1 (at least once) or 0 (at most once: cheaper, a frame may be lost; the
        sender then needs a deadline and a retry of its own, as ``runtime.collective_exchange`` has).
        Raises UnknownNodeError or PeerOfflineError if the receiver is not known to be online.
        """
        timeout = timeout_s or self.settings.publish_timeout_s
        conn = self._data_connection(node, service, timeout, peer_wait_s)
        topic = topics.from_sender(topics.data(node, service), self.sender.node)
        if expectation is None:
            env = self.sender.envelope(message)
        else:
            env = self.sender.envelope(message, correlation_id=expectation.correlation_id, reply_to=self.reply_topic)
        return self._publish_frames(conn, topic, env, message, value, timeout, self._links.get(node), qos)

    def reach(self, node: str, service: str, timeout_s: float | None = None) -> None:
        """Open the data-plane connection that tensors for ``service`` on ``node`` take (``send_tensor``'s), so
        that the first tensor sent there does not wait for its handshakes (TCP, TLS, MQTT: several round trips on a
        slow link). Raises what ``send_tensor`` raises for a receiver that is not known to be online, and
        BrokerUnavailableError when its broker cannot be reached within ``timeout_s`` seconds."""
        self._data_connection(node, service, timeout_s or self.settings.publish_timeout_s, None)

    def _data_connection(self, node: str, service: str, timeout_s: float, peer_wait_s: float | None
                         ) -> MqttConnection:
        wait = min(timeout_s, self.settings.request_timeout_s) if peer_wait_s is None else peer_wait_s
        status = self.peers.wait_for(node, service, timeout_s=wait)
        if status.state != "online":
            raise PeerOfflineError(f"{node}/{service} is offline ({status.reason or 'no reason given'})")
        return self.connection_for(status.data_url, timeout_s)

    def reply_tensor(self, request: Inbound, message: Message, value: Any) -> int:
        """Answer ``request`` with ``message`` and the tensor ``value`` on its ``reply_to`` topic (on the hub
        broker, where the requester listens), in chunks; returns bytes sent, 0 when the request named no reply
        topic of its own node (counted and logged, as ``reply`` does)."""
        target = self._reply_target(request)
        if target is None:
            return 0
        reply_to, correlation_id, ttl = target
        reply_env = self.sender.envelope(message, ttl_s=ttl, correlation_id=correlation_id)
        return self._publish_frames(self.hub, topics.from_sender(reply_to, self.sender.node), reply_env, message,
                                    value, self.settings.publish_timeout_s, None)

    def _publish_frames(self, conn: MqttConnection, topic: str, env: Envelope, message: Message, value: Any,
                        timeout: float, link: ShapedLink | None, qos: int = 1) -> int:
        chunk = self.settings.chunk_bytes
        # The header (envelope and body) is at most the schema's cap, so when even that leaves room for a whole chunk
        # the size is known without encoding the header once more just to measure it (a third of a small send).
        if conn.max_packet_bytes - (8 + message.MAX_BYTES + len(topic) + _CHUNK_HEADROOM) < chunk:
            headroom = len(encode(env, message)) + len(topic) + _CHUNK_HEADROOM
            chunk = max(1024, min(chunk, conn.max_packet_bytes - headroom))
        # No summary line on tensor frames: parsing it cost every receiving paho client 16 us a frame (wire format v2).
        options = mirrored(env, None, summary=False)
        sent = 0
        for frame in tensor_frames(env, message, value, chunk):
            send = partial(conn.publish, topic, frame, qos=qos, options=options, timeout_s=timeout, inbox=True)
            if link is None:
                send()
            else:
                link.transmit(len(frame), send)
            sent += len(frame)
        self.metrics.count("tensors_out")
        self.metrics.count("bytes_out", sent)
        return sent

    def connection_for(self, url: str, timeout_s: float = 10.0) -> MqttConnection:
        """The pooled connection to the broker at ``url``, connecting on first use."""
        known = self._conn_by_url.get(url)  # every send asks; parsing the URL each time cost 3 us a message
        if known is not None:
            return known
        key = parse_broker_url(url).url
        with self._pool_lock:
            conn = self._pool.get(key)
            if conn is None:
                conn = self._make_connection(key, f"dp{len(self._pool)}", None, None)
                conn.connect(timeout_s)
                self._pool[key] = conn
            if len(self._conn_by_url) < 1024:  # bounded: the URLs come from peers' statuses
                self._conn_by_url[url] = conn
        return conn

    # --- inbound ------------------------------------------------------------------------------------

    def _handle_raw(self, msg: InboundMessage) -> None:
        raw_handlers = self._raw_routes.match(msg.topic)
        if raw_handlers:
            self._dispatch_raw(msg, raw_handlers)
            if not self._routes.match(msg.topic):
                return  # only shown, not consumed: no decoding, no rejection counted or answered
        if not msg.payload:
            return  # a cleared retained topic: nothing to decode
        try:
            frame = decode(msg.payload, max_tensor_bytes=self.settings.max_tensor_bytes)
            check_writer(msg.topic, frame.envelope, frame.body)
            tensor = self._reassembler.add(frame) if frame.tensor is not None else None
        except ExpiredMessageError:
            self.metrics.count("expired")
            return
        except WireError as exc:
            self._reject(msg.topic, exc, peek_envelope(msg.payload))
            return
        env = frame.envelope
        if frame.tensor is not None:
            if tensor is None:
                return  # more chunks to come, or a duplicate chunk
            self.metrics.count("tensors_in")
        elif not msg.retain and self._already_seen(env.msg_id):
            self.metrics.count("duplicates")
            return
        self.metrics.count("messages_in")
        self.metrics.count("bytes_in", len(msg.payload))
        self._dispatch(Inbound(msg.topic, env, frame.body, tensor, msg.retain))

    def _dispatch(self, inbound: Inbound) -> None:
        """Run every handler subscribed to ``inbound.topic`` that accepts its schema, isolating failures."""
        routes = [r for r in self._routes.match(inbound.topic) if isinstance(r, _Route)]
        accepted = [r for r in routes if r.schemas is None or isinstance(inbound.body, r.schemas)]
        if routes and not accepted:
            self._reject(inbound.topic, WireError(
                f"schema {inbound.envelope.schema_name} is not accepted on this topic", reason="unexpected_schema"),
                inbound.envelope.model_dump())
            return
        for route in accepted:
            try:
                route.handler(inbound)
            except WireError as exc:
                self._reject(inbound.topic, exc, inbound.envelope.model_dump())
            except Exception:
                self.metrics.count("handler_errors")
                log.exception("handler %s failed on %s from %s", getattr(route.handler, "__qualname__", route.handler),
                              inbound.topic, inbound.sender)

    def _dispatch_raw(self, msg: InboundMessage, handlers: list[object]) -> None:
        raw = RawInbound(msg.topic, bytes(msg.payload), msg.retain, msg.qos)
        for handler in handlers:
            try:
                handler(raw)  # type: ignore[operator]
            except Exception:
                self.metrics.count("handler_errors")
                log.exception("raw handler %s failed on %s", getattr(handler, "__qualname__", handler), msg.topic[:256])

    def _on_refused(self, mid: int, why: str) -> None:
        """The hub broker refused QoS 1 message ``mid`` (runs on the network thread): fail its request now."""
        with self._pending_lock:
            cid = self._request_mids.pop(mid, None)
            pending = self._pending.get(cid) if cid is not None else None
        if pending is not None:
            pending._refuse(why)

    def _resolve_reply(self, inbound: Inbound) -> None:
        cid = inbound.envelope.correlation_id or ""
        with self._pending_lock:
            pending = self._pending.get(cid)
        if pending is None:
            self.metrics.count("late_replies")
            return
        pending._resolve(inbound)

    def _reject(self, topic: str, exc: WireError, env: dict[str, Any] | None) -> None:
        self.metrics.count(f"rejected.{exc.reason}")
        sender = f"{env.get('sender_node', '?')}/{env.get('sender_service', '?')}" if env else "unknown sender"
        self._reject_log.warning(exc.reason, "rejected a message on %s from %s: %s", topic[:256], sender, exc)
        if exc.reason not in ("forged_sender", "expired"):  # a forger's reply_to is not its own to receive
            self._answer_rejected(topic, env, exc.reason, str(exc))

    def _on_dropped(self, msg: InboundMessage, depth: int) -> None:
        """The inbox had no room for QoS 0 ``msg`` (runs on the network thread: only counts, logs and queues)."""
        self.metrics.count("inbox_dropped")
        self._reject_log.warning("inbox_full", "inbox full (%d queued): dropped a QoS %d message on %s", depth,
                                 msg.qos, msg.topic[:256])
        if self._is_request_to_me(msg.topic) and self._rejection_tokens.take():
            self._queue_rejection(msg.topic, peek_envelope(msg.payload), "overflow",
                                  f"the {self.sender.service} on {self.sender.node} is overloaded ({depth} messages "
                                  "queued); try again later", rate_checked=True)

    def _on_held(self, msg: InboundMessage, depth: int) -> None:
        """A QoS 1 message found its shard full for the whole hold (runs on the network thread): its connection was
        given back for the broker to send it again."""
        self._reject_log.warning("inbox_held", "inbox full (%d queued) for %.1f s: a QoS 1 message on %s goes back "
                                 "to the broker, which sends it again after reconnecting", depth, self._inbox.hold_s,
                                 msg.topic[:256])

    def _answer_rejected(self, topic: str, env: dict[str, Any] | None, reason: str, detail: str) -> None:
        if self._is_request_to_me(topic):
            self._queue_rejection(topic, env, reason, detail, rate_checked=False)

    def _is_request_to_me(self, topic: str) -> bool:
        parts = topic.split("/")
        return (len(parts) == 6 and parts[1] == "node" and parts[2] == self.sender.node and parts[4] == "request")

    def _queue_rejection(self, topic: str, env: dict[str, Any] | None, reason: str, detail: str, *,
                         rate_checked: bool) -> None:
        """Queue a RequestRejected for a request on ``topic`` whose (unvalidated) envelope is ``env``, if that
        envelope names a reply topic of the node the request topic says it came from."""
        if not isinstance(env, dict):
            return
        reply_to, cid, sender = env.get("reply_to"), env.get("correlation_id") or env.get("msg_id"), env.get(
            "sender_node")
        if not (isinstance(reply_to, str) and isinstance(cid, str) and isinstance(sender, str) and len(cid) <= 64
                and topics.writer_of(topic) == sender and topics.reply_owner(reply_to) == sender):
            return
        if not rate_checked and not self._rejection_tokens.take():
            return
        if not self._rejections.offer(_Rejection(reply_to, cid, reason, detail[:1024])):
            self.metrics.count("rejections_unanswered")

    def _answer_rejection(self, r: _Rejection) -> None:
        try:
            self.publish(r.reply_to, RequestRejected(reason=r.reason, detail=r.detail), qos=0,
                         correlation_id=r.correlation_id, ttl_s=30.0, timeout_s=1.0)
        except Exception as exc:  # noqa: BLE001 - an answer that cannot be sent is only counted
            self.metrics.count("rejections_unanswered")
            log.debug("could not answer a rejected request: %s", exc)

    def _already_seen(self, msg_id: str) -> bool:
        with self._seen_lock:
            if msg_id in self._seen:
                return True
            self._seen[msg_id] = None
            if len(self._seen) > 8192:
                self._seen.popitem(last=False)
            return False

    # --- plumbing -----------------------------------------------------------------------------------

    def _make_connection(self, url: str, role: str, will: Will | None,
                         on_connected: Callable[[], None] | None) -> MqttConnection:
        s = self.settings
        return MqttConnection(
            url,
            # The random tail keeps a client id unguessable (the instance id is public, in the status): a broker
            # drops the older of two connections with one id, so a known id would let anyone disconnect us.
            f"{self.sender.node}.{self.sender.service}.{self.sender.instance}.{role}.{new_id()[:8]}",
            protocol=s.mqtt_protocol,
            keepalive_s=s.keepalive_s,
            max_packet_bytes=s.max_packet_bytes,
            window_messages=s.outbound_window_messages,
            session_expiry_s=s.session_expiry_s,
            on_message=self._enqueue,
            on_connected=on_connected,
            will=will,
            credentials=self.credentials,
            on_refused=self._on_refused if role == "hub" else None,
        )

    def _enqueue(self, msg: InboundMessage) -> None:
        if not msg.topic.startswith(self._reply_prefix):
            self._inbox.put(msg)
            return
        # Replies are small control messages and resolving one only sets an event, so they are handled
        # on the network thread: a thread hand-off less on every round trip, and a handler blocked in
        # request() can never wait for a reply queued behind itself. Nothing may escape into paho's thread:
        # it would end it, and this bus would never receive again.
        try:
            self._handle_raw(msg)
        except Exception:  # noqa: BLE001 - the last guard of the network thread
            self.metrics.count("handler_errors")
            self._reject_log.warning("reply_error", "a reply on %s could not be handled", msg.topic[:256],
                                     exc_info=True)
        finally:
            msg.ack()

    def _on_hub_connected(self) -> None:
        if self.hub.connects > 1:
            for hook in self._reconnect_hooks:
                threading.Thread(target=hook, name="reconnect-hook", daemon=True).start()

    def _housekeeping(self) -> None:
        while not self._stop.wait(1.0):
            self._reassembler.sweep()
            freed = self._reassembler.expired_transfers - self._timeouts_counted
            if freed:
                self._timeouts_counted += freed
                self.metrics.count("reassembly_timeouts", freed)
                log.warning("freed %d incomplete tensor transfer(s) after %.0f s without a chunk",
                            freed, self.settings.reassembly_timeout_s)
            self.metrics.gauge("inbox_depth", self._inbox.depth)
            self.metrics.gauge("reassembly_bytes", self._reassembler.pending_bytes)
            self.metrics.gauge("duplicate_chunks", self._reassembler.duplicate_chunks)

    @property
    def inbox_depth(self) -> int:
        return self._inbox.depth

    @property
    def inbox_saturated(self) -> bool:
        return self._inbox.saturated
