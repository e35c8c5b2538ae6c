"""One MQTT connection: the only module in edgeswarm that touches paho-mqtt.

It speaks MQTT 5 and falls back to 3.1.1 when the broker refuses 5 (amqtt), logs in with the node's
credentials and speaks TLS to ``mqtts://`` brokers, sets TCP_NODELAY on every socket it opens,
resubscribes after each reconnect, refuses messages larger than the broker's maximum packet size before
sending them, and bounds the messages waiting for a PUBACK (a sender blocks instead of growing memory).
Inbound messages are handed to a callback that only enqueues them (waiting, boundedly, for room: TCP
backpressure), and QoS 1 messages are acknowledged when their handler is done, on the connection they came
on; MQTT 5 sessions outlive a connection, so a reconnect gets again what was left unacknowledged. No
exception reaches paho's thread (it would end it silently); ``network_alive`` tells whether that thread still
runs. A publish or subscription the broker refuses (its ACL) is logged and reported, not silently lost.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import socket
import ssl
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.matcher import MQTTMatcher
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from edgeswarm.bus.unheard import NO_MATCHING_SUBSCRIBERS, Unheard, UnheardResender
from edgeswarm.errors import (
    BrokerUnavailableError,
    InvalidTopicError,
    NotAuthorizedError,
    PayloadTooLargeError,
    PublishTimeoutError,
)
from edgeswarm.logs import RateLimitedLog
from edgeswarm.settings import BrokerCredentials, parse_broker_url

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

_UNSUPPORTED_PROTOCOL = (1, 0x84)  # CONNACK codes for "unsupported protocol version" in 3.1.1 and 5
_V5_ANSWER_S = 3.0  # how long an MQTT 5 CONNECT may go unanswered before trying 3.1.1
_KNOWN_V311: dict[str, bool] = {}  # brokers this process already found to speak only 3.1.1
# CONNACK codes meaning "who you are is not accepted": 3.1.1 bad user name or password / not authorised,
# MQTT 5 bad user name or password / not authorised / banned / bad authentication method.
_CREDENTIALS_REFUSED = (4, 5, 0x86, 0x87, 0x8A, 0x8C)
_REMEMBERED_REFUSALS = 256

F = TypeVar("F", bound=Callable[..., Any])


def _guarded(method: F) -> F:
    """A paho callback that never raises: an exception escaping into paho's network thread ends the thread, and
    with it every message this connection would ever receive."""

    @functools.wraps(method)
    def wrapper(self: MqttConnection, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception:  # noqa: BLE001 - the last guard of the network thread
            _limited.log(logging.ERROR, f"callback:{method.__name__}", "%s on %s failed", method.__name__,
                         self.url, exc_info=True)
            return None

    return wrapper  # type: ignore[return-value]


class Session:
    """One MQTT connection's life, from its CONNACK to its end: the packet ids of the QoS 1 messages it delivered
    mean something only to it. ``resumed``: the broker kept the previous connection's session (MQTT 5 session
    present), so it sends again whatever that connection left unacknowledged."""

    __slots__ = ("_conn", "resumed", "given_back")

    def __init__(self, conn: MqttConnection | None, resumed: bool) -> None:
        self._conn = conn
        self.resumed = resumed
        self.given_back = False  # its messages were handed back for redelivery: none is acknowledged any more

    @property
    def current(self) -> bool:
        return self._conn is not None and self._conn._session is self

    def ack(self, mid: int, qos: int) -> None:
        # A packet id of an ended session is another message's on the next one: never acknowledged there.
        if qos > 0 and self.current and not self.given_back:
            self._conn._client.ack(mid, qos)  # type: ignore[union-attr]

    def ack_all(self, mids: list[int]) -> None:
        """Acknowledge the QoS 1 messages ``mids`` of this session in one write."""
        if mids and self.current and not self.given_back:
            self._conn._client.ack_all(mids)  # type: ignore[union-attr]


_NO_SESSION = Session(None, False)


def split_publish(packet: bytearray | bytes, qos: int) -> tuple[bytes, int, memoryview]:
    """An MQTT 5 PUBLISH packet's variable header and payload (everything after the fixed header): its topic (bytes),
    packet id (0 at QoS 0) and payload, a view of ``packet`` (no copy). The properties are skipped: the bus reads
    none of them (the envelope in the payload is authoritative). Raises ValueError for a packet too short for what
    it declares, or a topic of length 0 (a topic alias, which the bus never allows the broker to use)."""
    view = memoryview(packet)
    size = len(view)
    if size < 2:
        raise ValueError("a PUBLISH shorter than its topic length")
    end = 2 + int.from_bytes(view[0:2], "big")
    if end == 2:
        raise ValueError("a PUBLISH with an empty topic")
    topic = bytes(view[2:end])
    mid = 0
    if qos:
        mid = int.from_bytes(view[end:end + 2], "big")
        end += 2
    length, shift = 0, 0
    for _ in range(4):  # the properties' length, a variable byte integer of at most four bytes
        if end >= size:
            raise ValueError("a PUBLISH cut short before its properties")
        byte = view[end]
        end += 1
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    else:
        raise ValueError("a PUBLISH property length longer than four bytes")
    end += length
    if end > size:
        raise ValueError("a PUBLISH whose properties run past its end")
    return topic, mid, view[end:]


Deliver = Callable[[bytes, "bytes | memoryview", int, bool, bool, int], None]
_PUBLISH, _PUBACK = 0x30, 0x40  # MQTT control packet types, the high nibble of the first byte
_PUBACK_SUCCESS = ReasonCode(PacketTypes.PUBACK)  # "Success": read by on_publish, never changed
_PUBACK_PROPERTIES = Properties(PacketTypes.PUBACK)
_PUBACK_PACKET = struct.Struct("!BBH")  # a PUBACK that says success: type, remaining length 2, packet id


def _written_directly(command: int, qos: int) -> bool:
    """Whether a queued packet may be written by the thread that queued it: a QoS 1 PUBLISH or a PUBACK."""
    kind = command & 0xF0
    return kind == _PUBACK or (kind == _PUBLISH and qos == 1)


# Bytes the network thread asks the socket for at once: paho read each packet in three or more recv calls (its
# first byte, then its length a byte at a time, then the rest), a system call and a select() wake-up each.
_READ_AHEAD = 65536


class _Client(paho.Client):
    """paho's client, with leaner reading and writing of what the bus exchanges. Four changes, each measured
    (docs/bus-rate.md):

    * PUBLISH (MQTT 5, QoS 0 or 1, acknowledged by the bus): paho's decoder copied the packet three times over while
      cutting it (struct.unpack of the rest after each field), built a Properties object nobody reads (11 us even
      when empty), then an MQTTMessage, and matched the topic against per-topic callbacks the bus never sets. Here
      the fields are read from a view of the received packet and ``deliver(topic, payload, qos, retain, dup, mid)``
      gets the payload as a view of it (paho starts a new buffer for the next packet). Anything else (MQTT 3.1.1,
      QoS 2, no ``deliver``) goes through paho's path.
    * A PUBACK that says success in its two bytes (no reason code, no properties) is not decoded into a new
      ReasonCode and Properties: the bus's on_publish gets shared ones.
    * The socket is read ahead, up to _READ_AHEAD bytes at a time, and every whole packet already read is handled
      before the network thread goes back to select().
    * A QoS 1 PUBLISH or a PUBACK queued by another thread (a service's sending thread, an inbox worker's
      acknowledgement) is written to a plain TCP socket by that thread at once when no other thread is writing,
      instead of waking the network thread through its socket pair to write it: a thread hand-off and a select()
      wake-up less per message. Anything else, anything on TLS (an SSL connection must not be read and written from
      two threads at once), and whatever cannot be written whole at once goes the network thread's way.

    Besides, ``ack_all`` queues the PUBACKs of several messages as one write (the inbox's acknowledgement batching).
    """

    deliver: Deliver | None = None
    _ahead: tuple[object, memoryview, int] | None = None  # (the socket it came from, bytes read ahead, next offset)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._write_lock = threading.Lock()  # held by whichever thread writes queued packets to the socket

    def _packet_write(self) -> MQTTErrorCode:
        with self._write_lock:
            return super()._packet_write()  # type: ignore[no-any-return]

    def _packet_queue(self, command: int, packet: bytes | bytearray, mid: int, qos: int,
                      info: paho.MQTTMessageInfo | None = None) -> MQTTErrorCode:
        thread = self._thread
        if (not _written_directly(command, qos) or thread is None or thread is threading.current_thread()
                or type(self._sock) is not socket.socket):
            return super()._packet_queue(command, packet, mid, qos, info)  # type: ignore[no-any-return]
        self._out_packet.append({"command": command, "mid": mid, "qos": qos, "pos": 0, "to_process": len(packet),
                                 "packet": packet, "info": info})
        if self._write_lock.acquire(blocking=False):
            try:
                if self._write_queued():
                    return MQTTErrorCode.MQTT_ERR_SUCCESS
            finally:
                self._write_lock.release()
        pair = self._sockpairW
        if pair is not None:  # left for the network thread: wake it, as paho does
            try:
                pair.send(b"0")
            except BlockingIOError:
                pass
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def _write_queued(self) -> bool:
        """Write the queued packets from this thread while they are QoS 1 PUBLISHes and PUBACKs that go out whole;
        True when nothing is left queued. Holds the write lock."""
        sock, queued = self._sock, self._out_packet
        while queued:
            packet = queued[0]
            if not _written_directly(packet["command"], packet["qos"]) or type(sock) is not socket.socket:
                return False
            try:
                sent = sock.send(memoryview(packet["packet"])[packet["pos"]:])
            except OSError:  # full (BlockingIOError) or failing: the network thread retries, or sees the loss
                return False
            packet["pos"] += sent
            packet["to_process"] -= sent
            if packet["to_process"] > 0:
                return False
            queued.popleft()
            with self._msgtime_mutex:
                self._last_msg_out = time.monotonic()
        return True

    def _sock_recv(self, bufsize: int) -> bytes:
        ahead = self._ahead
        if ahead is not None:
            sock, data, at = ahead
            if sock is self._sock and at < len(data):
                end = min(len(data), at + bufsize)
                self._ahead = (sock, data, end)
                return data[at:end]  # type: ignore[return-value] - paho only indexes, measures and appends it
            self._ahead = None
        got = super()._sock_recv(max(bufsize, _READ_AHEAD))
        if len(got) <= bufsize:
            return got
        view = memoryview(got)
        self._ahead = (self._sock, view, bufsize)
        return view[:bufsize]  # type: ignore[return-value]

    def loop_read(self, max_packets: int = 1) -> MQTTErrorCode:
        rc = super().loop_read(max_packets)
        # Packets already read ahead leave no event on the socket to wake select() for them: handle them now.
        while rc == MQTTErrorCode.MQTT_ERR_SUCCESS and self._buffered():
            rc = super().loop_read(1)
        return rc

    def _buffered(self) -> bool:
        ahead = self._ahead
        return ahead is not None and ahead[0] is self._sock and ahead[2] < len(ahead[1])

    def ack_all(self, mids: list[int]) -> None:
        """PUBACKs for the QoS 1 messages ``mids``, queued (and so written) as one packet of packets."""
        if len(mids) == 1:
            self.ack(mids[0], 1)
            return
        packet = b"".join(_PUBACK_PACKET.pack(_PUBACK, 2, mid) for mid in mids)
        self._packet_queue(_PUBACK, packet, mids[0], 1)

    def _handle_pubackcomp(self, cmd: Literal["PUBACK", "PUBCOMP"]) -> MQTTErrorCode:
        packet = self._in_packet["packet"]
        if cmd != "PUBACK" or len(packet) != 2:
            return super()._handle_pubackcomp(cmd)
        mid = int.from_bytes(packet, "big")
        with self._out_message_mutex:
            if mid in self._out_messages:
                return self._do_on_publish(mid, _PUBACK_SUCCESS, _PUBACK_PROPERTIES)  # type: ignore[no-any-return]
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def _handle_publish(self) -> MQTTErrorCode:
        deliver = self.deliver
        header = self._in_packet["command"]
        qos = (header & 0x06) >> 1
        if deliver is None or self._protocol != paho.MQTTv5 or qos == 2 or not self._manual_ack:
            return super()._handle_publish()
        try:
            topic, mid, payload = split_publish(self._in_packet["packet"], qos)
        except ValueError as exc:
            raise MalformedPacket(str(exc)) from exc  # paho ends the connection, as for a packet it cannot read
        with self._in_callback_mutex:
            deliver(topic, payload, qos, bool(header & 0x01), bool(header & 0x08), mid)
        return MQTTErrorCode.MQTT_ERR_SUCCESS


class InboundMessage:
    """A message as it came off the socket. Call ``ack()`` once when it has been handled, or ``redeliver()`` to
    have the broker send it (and everything after it on its connection) again instead."""

    __slots__ = ("topic", "payload", "qos", "retain", "dup", "_mid", "_session")

    def __init__(self, topic: str, payload: bytes | memoryview, qos: int, retain: bool = False, dup: bool = False, *,
                 mid: int = 0, session: Session = _NO_SESSION) -> None:
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.dup = dup
        self._mid = mid
        self._session: Session | None = session

    def ack(self) -> None:
        """Acknowledge to the broker (QoS 1) that this message was handled; only the first call counts."""
        session, self._session = self._session, None
        if session is not None:
            session.ack(self._mid, self.qos)

    def redeliver(self) -> bool:
        """Leave this QoS 1 message unacknowledged and have the broker deliver it again: the connection it came on
        ends cleanly (no Will) and reconnects to its kept session, whose unacknowledged messages the broker sends
        again in their order. Runs on the network thread. False where the broker keeps no session to send them
        from (MQTT 3.1.1 connections are clean): the message must then be handled."""
        session = self._session
        if session is None or self.qos == 0 or session._conn is None or not session._conn._give_back(session):
            return False
        self._session = None
        return True

    @staticmethod
    def ack_together(messages: list[InboundMessage]) -> None:
        """``ack()`` each of ``messages``; the QoS 1 ones of one connection go out in one write."""
        if len(messages) == 1:  # the usual case when nothing queues: no grouping on the way
            messages[0].ack()
            return
        batches: dict[Session, list[int]] = {}
        for msg in messages:
            session, msg._session = msg._session, None
            if session is None:
                continue
            if msg.qos == 1:
                batches.setdefault(session, []).append(msg._mid)
            else:
                session.ack(msg._mid, msg.qos)
        for session, mids in batches.items():
            session.ack_all(mids)

    @property
    def superseded(self) -> bool:
        """True when this QoS 1 message's connection was given back (``redeliver``) and a later one resumed the
        session: the broker, which was up all along, sends this message again, so this copy is not handled. After
        any other reconnect (a lost link, a restarted broker whose saved session may be older than what it had sent)
        the copy is handled, and one the broker sends again is dropped as a duplicate by its envelope's id."""
        session = self._session
        if session is None or self.qos == 0 or not session.given_back or session._conn is None or session.current:
            return False
        return session._conn._session.resumed


@dataclass(frozen=True)
class Will:
    """The Last Will: published by the broker (retained) if this connection dies without a DISCONNECT."""

    topic: str
    payload: bytes


@dataclass(frozen=True)
class PublishOptions:
    """Envelope fields mirrored into MQTT 5 properties (ignored on 3.1.1, where the envelope alone carries them).

    ``envelope`` is the rest of the envelope in one line (message id, schema and sender) for MQTT 5
    tools; it travels as the user property ``edgeswarm`` (None on tensor frames: no user property).
    """

    expires_in_s: float | None = None
    reply_to: str | None = None
    correlation_id: str | None = None
    envelope: str | None = None


class TopicRouter:
    """Maps subscription filters to values and finds every value whose filter matches a topic.

    Matches are cached per topic (topics repeat: a service sees the same few over and over); adding a
    filter clears the cache.
    """

    def __init__(self) -> None:
        self._matcher = MQTTMatcher()
        self._lock = threading.Lock()
        self._cache: dict[str, list[object]] = {}

    def add(self, topic_filter: str, value: object) -> None:
        with self._lock:
            try:
                self._matcher[topic_filter].append(value)
            except KeyError:
                self._matcher[topic_filter] = [value]
            self._cache.clear()

    def match(self, topic: str) -> list[object]:
        with self._lock:
            found = self._cache.get(topic)
            if found is None:
                found = [v for values in self._matcher.iter_match(topic) for v in values]
                if len(self._cache) > 4096:
                    self._cache.clear()
                self._cache[topic] = found
            return found


class MqttConnection:
    """A paho client with reconnects, resubscription, packet-size enforcement and a bounded send queue.

    ``max_packet_bytes`` is the configured cap; after connecting, the broker's CONNACK
    MaximumPacketSize (MQTT 5) lowers it if smaller. ``window_messages`` bounds QoS 1 messages not yet
    acknowledged by the broker; ``publish`` blocks up to its timeout when the window is full.
    """

    def __init__(
        self,
        url: str,
        client_id: str,
        *,
        protocol: str = "auto",
        keepalive_s: int = 10,
        max_packet_bytes: int = 16 * 1024 * 1024,
        window_messages: int = 32,
        session_expiry_s: int = 120,
        on_message: Callable[[InboundMessage], None] | None = None,
        on_connected: Callable[[], None] | None = None,
        will: Will | None = None,
        credentials: BrokerCredentials | None = None,
        on_refused: Callable[[int, str], None] | None = None,
    ) -> None:
        self.address = parse_broker_url(url)
        self.url = self.address.url
        self.client_id = client_id
        self.credentials = credentials or BrokerCredentials()
        self._on_refused = on_refused
        # Each QoS 1 message by packet id until the broker acknowledges it: its topic (for a refusal's warning) and,
        # for a message to an inbox, what to hold and send again if the broker heard no one for it (``bus.unheard``).
        self._inflight: dict[int, tuple[str, Unheard | None]] = {}
        self._unheard = UnheardResender(self._send_again, label=self.url)
        self._refusals: OrderedDict[int, str] = OrderedDict()
        self._refused_subscriptions: dict[int, str] = {}
        self._net_thread: threading.Thread | None = None
        self._protocol_setting = protocol
        self._keepalive = keepalive_s
        self._cap = max_packet_bytes
        self._window = window_messages
        self._on_message = on_message
        self._on_connected = on_connected
        self._will = will
        self._subscriptions: dict[str, int] = {}
        self._sub_lock = threading.Lock()
        self._subacks: dict[int, threading.Event] = {}
        self._early_subacks: dict[int, threading.Event] = {}
        self._connected = threading.Event()
        self._progress = threading.Event()
        self._last_info: paho.MQTTMessageInfo | None = None
        self._refused: int | None = None
        self._socket_opened_at: float | None = None
        self._closing = False
        self._session_expiry_s = session_expiry_s
        self._restarting = False
        self._session = _NO_SESSION
        self._restart_lock = threading.Lock()
        self.protocol = "5" if protocol in ("auto", "5") else "3.1.1"
        self.broker_max_packet: int | None = None
        self.connects = 0
        self._client = self._make_client()

    # --- lifecycle ----------------------------------------------------------------------------------

    def connect(self, timeout_s: float = 10.0) -> None:
        """Connect and wait for the first CONNACK; falls back to MQTT 3.1.1 when allowed and needed.

        Raises BrokerUnavailableError if the broker cannot be reached or refuses within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        auto = self._protocol_setting == "auto"
        if auto and _KNOWN_V311.get(self.url) and self.protocol == "5":
            self._client = self._make_client_for("3.1.1")
        self._start()
        if auto and self.protocol == "5":
            # A 3.1.1-only broker either refuses MQTT 5 in its CONNACK or, like amqtt given CONNECT
            # properties, accepts the TCP connection and never answers; either way try 3.1.1. A broker
            # that is not reachable at all says nothing about its protocol, so keep trying 5 then.
            # The window runs from the TCP connection, not from the call: a busy broker can take seconds
            # just to accept, and a window that ran out first would leave us retrying MQTT 5 forever.
            while (time.monotonic() < deadline and not self._connected.is_set() and self._refused is None
                   and (self._socket_opened_at is None or time.monotonic() - self._socket_opened_at < _V5_ANSWER_S)):
                self._connected.wait(0.02)
            answered_wrong = self._refused in _UNSUPPORTED_PROTOCOL
            silent = self._refused is None and self._socket_opened_at is not None and not self._connected.is_set()
            if answered_wrong or silent:
                log.info("broker %s did not accept MQTT 5; falling back to 3.1.1", self.url)
                self._stop_client()
                _KNOWN_V311[self.url] = True
                self._client = self._make_client_for("3.1.1")
                self._start()
        self._wait(deadline)
        if not self._connected.is_set():
            self._stop_client()
            if self._refused in _CREDENTIALS_REFUSED:
                who = (f"user {self.credentials.username!r}" if self.credentials.username else
                       "a client certificate" if self.credentials.cert_file else "an anonymous client")
                raise NotAuthorizedError(
                    f"the MQTT broker at {self.url} refused {who} (CONNACK code {self._refused}); check "
                    "EDGESWARM_MQTT_USERNAME and EDGESWARM_MQTT_PASSWORD_FILE against the broker's password file "
                    "(`edgeswarm credentials`)")
            if self._refused is None and self._socket_opened_at is None:
                # Never even a TCP connection: say why (paho's thread only retried), so a typo in the host name
                # does not read like a broker that is down.
                reason = unreachable_reason(self.address.host, self.address.port)
                if reason is not None:
                    raise BrokerUnavailableError(
                        f"cannot connect to the MQTT broker at {self.url}: {reason}; check the URL (--hub or "
                        "EDGESWARM_HUB_URL) or start a broker there (`edgeswarm up --local`)")
            why = f"refused with code {self._refused}" if self._refused is not None else "no answer"
            raise BrokerUnavailableError(
                f"cannot connect to the MQTT broker at {self.url} ({why} within {timeout_s:.0f} s); "
                "is it running? (start one with `edgeswarm up --local`, or set EDGESWARM_HUB_URL)"
            )

    def close(self) -> None:
        """Disconnect cleanly (the broker does not publish the Will) and stop the network thread."""
        self._closing = True
        self._unheard.close()
        self._stop_client()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def network_alive(self) -> bool:
        """False once paho's network thread, which this connection started, has ended without being asked to."""
        thread = self._net_thread
        return self._closing or thread is None or thread.is_alive()

    @property
    def max_packet_bytes(self) -> int:
        """The largest packet this connection may send, in bytes."""
        return min(self._cap, self.broker_max_packet or self._cap)

    # --- subscriptions ------------------------------------------------------------------------------

    def subscribe(self, topic_filter: str, qos: int = 1, timeout_s: float = 10.0) -> None:
        """Subscribe, and again after every reconnect. If connected, waits up to ``timeout_s`` for the
        broker's SUBACK, so that messages published after this returns are delivered."""
        with self._sub_lock:
            self._subscriptions[topic_filter] = qos
        if not self._connected.is_set():
            return
        _rc, mid = self._client.subscribe(topic_filter, qos)
        if mid is None:
            return
        with self._sub_lock:
            acked = self._early_subacks.pop(mid, None)
            if acked is None:
                acked = self._subacks.setdefault(mid, threading.Event())
        if not acked.wait(timeout_s):
            log.warning("no SUBACK for %s from %s within %.0f s", topic_filter, self.url, timeout_s)
        with self._sub_lock:
            self._subacks.pop(mid, None)
            refused = self._refused_subscriptions.pop(mid, None)
        if refused is not None:
            with self._sub_lock:
                self._subscriptions.pop(topic_filter, None)
            raise NotAuthorizedError(
                f"the broker at {self.url} refused the subscription to {topic_filter} ({refused}): user "
                f"{self.credentials.username!r} may not read it (the ACL: `edgeswarm topics` says who reads what)")

    # --- publishing ---------------------------------------------------------------------------------

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                options: PublishOptions | None = None, timeout_s: float = 30.0, inbox: bool = False) -> int:
        """Hand one message to the broker connection; returns its packet id (0 for QoS 0).

        Raises PayloadTooLargeError (nothing is sent) if the packet would exceed ``max_packet_bytes``,
        and PublishTimeoutError if the send window stays full for ``timeout_s`` seconds. QoS 1 messages
        published while disconnected are queued (within the window) and sent after reconnecting. If the
        broker later refuses a QoS 1 message (MQTT 5 PUBACK "not authorised"), ``refusal(mid)`` says why.
        ``inbox``: the topic is a service's inbox, which always has a subscriber but for moments between its
        connections; a QoS 1 message the broker heard no one for is then held and sent again (``bus.unheard``),
        for up to the session expiry.
        """
        watch = None
        if inbox and qos == 1 and self.protocol == "5":
            watch = Unheard(topic, payload, retain, options, time.monotonic() + self._session_expiry_s)
        return self._publish(topic, payload, qos, retain, options, timeout_s, watch)

    def _send_again(self, msg: Unheard) -> None:
        """The resender's ``send``: ``msg`` once more, as it was published."""
        if self._closing:
            raise ConnectionError("closing")
        self._publish(msg.topic, msg.payload, 1, msg.retain, msg.options, max(0.1, msg.give_up_at - time.monotonic()),
                      msg)

    def _publish(self, topic: str, payload: bytes, qos: int, retain: bool, options: PublishOptions | None,
                 timeout_s: float, watch: Unheard | None) -> int:
        problem = topic_problem(topic)
        if problem is not None:
            # Checked here, not left to the broker: it would drop the connection, and paho would send the QoS 1
            # message again after every reconnect, so one bad topic would cut this connection off for good.
            raise InvalidTopicError(f"cannot publish to {topic[:256]!r}: {problem}")
        props = _PackedProperties(publish_properties(options)) if self.protocol == "5" else None
        size = packet_size(topic, len(payload), qos, props)
        if size > self.max_packet_bytes:
            raise PayloadTooLargeError(
                f"a {size}-byte packet on {topic} exceeds the broker's maximum packet size of "
                f"{self.max_packet_bytes} bytes ({self.url}); tensors are chunked automatically, "
                "other messages must be smaller"
            )
        deadline = time.monotonic() + timeout_s
        while True:
            self._progress.clear()
            if qos == 0:
                info = self._client.publish(topic, payload, qos=qos, retain=retain, properties=props)
            else:
                # Held while the packet id is recorded: paho acknowledges a message (``_handle_publish``) only with
                # this lock, so the acknowledgement always finds it.
                with self._client._out_message_mutex:  # noqa: SLF001
                    info = self._client.publish(topic, payload, qos=qos, retain=retain, properties=props)
                    if info.rc != MQTTErrorCode.MQTT_ERR_QUEUE_SIZE:
                        self._record(info.mid, topic, watch)
            if info.rc != MQTTErrorCode.MQTT_ERR_QUEUE_SIZE:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PublishTimeoutError(
                    f"publish to {topic} on {self.url} waited {timeout_s:.1f} s for the broker to acknowledge "
                    f"earlier messages ({self._window} in flight); the broker or the link is too slow or down"
                )
            self._progress.wait(min(remaining, 0.02))
        if info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN and qos == 0:
            log.debug("dropped a QoS 0 message on %s: not connected to %s", topic, self.url)
        elif qos > 0:
            self._last_info = info
            return int(info.mid)
        return 0

    def _record(self, mid: int, topic: str, watch: Unheard | None) -> None:
        with self._sub_lock:
            self._inflight[mid] = (topic, watch)
            if len(self._inflight) > 4 * self._window:  # acknowledged long ago, or lost with a session
                self._inflight.pop(next(iter(self._inflight)))

    @property
    def unheard(self) -> UnheardResender:
        """What this connection holds for inboxes that heard no one (see ``bus.unheard``)."""
        return self._unheard

    def refusal(self, mid: int) -> str | None:
        """Why the broker refused QoS 1 message ``mid``, or None if it did not (or has not said yet)."""
        with self._sub_lock:
            return self._refusals.get(mid)

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the broker to acknowledge the last QoS 1 message; True if it did. It returns at
        once (False) while disconnected, and on the network thread, which alone reads the acknowledgement."""
        info = self._last_info
        if info is None:
            return True
        try:
            if info.is_published():
                return True
            if not self._connected.is_set() or threading.current_thread() is self._net_thread:
                return False
            info.wait_for_publish(timeout_s)
            return info.is_published()
        except (ValueError, RuntimeError):  # paho: the message was never queued, or the client is not connected
            return False

    # --- paho plumbing ------------------------------------------------------------------------------

    def _make_client_for(self, protocol: str) -> paho.Client:
        self.protocol = protocol
        return self._make_client()

    def _make_client(self) -> paho.Client:
        v5 = self.protocol == "5"
        client = _Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=paho.MQTTv5 if v5 else paho.MQTTv311,
            clean_session=None if v5 else True,
            manual_ack=True,
        )
        client.deliver = self._deliver
        creds = self.credentials
        if creds.username is not None:
            client.username_pw_set(creds.username,
                                   creds.password.get_secret_value() if creds.password is not None else None)
        if self.address.tls:
            client.tls_set(ca_certs=str(creds.ca_file) if creds.ca_file else None,
                           certfile=str(creds.cert_file) if creds.cert_file else None,
                           keyfile=str(creds.key_file) if creds.key_file else None,
                           cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)
        client.max_inflight_messages_set(min(self._window, 65535))
        client.max_queued_messages_set(self._window)
        client.reconnect_delay_set(min_delay=1, max_delay=4)
        client.on_socket_open = self._handle_socket_open
        client.on_connect = self._handle_connect
        client.on_disconnect = self._handle_disconnect
        client.on_message = self._handle_message
        client.on_publish = self._handle_publish
        client.on_subscribe = self._handle_subscribe
        if self._will is not None:
            client.will_set(self._will.topic, self._will.payload, qos=1, retain=True)
        return client

    def _start(self) -> None:
        self._refused = None
        self._closing = False
        self._socket_opened_at = None
        self._connect_async()
        try:
            self._client.loop_start()
        except OSError as exc:
            # paho wakes its network thread through a socket pair it connects on 127.0.0.1: in a network
            # namespace whose loopback is down that fails before any broker is tried.
            raise BrokerUnavailableError(
                f"cannot start the MQTT client for {self.url}: {exc} on 127.0.0.1, which the client needs for its "
                "own wake-ups; bring the loopback interface up (in a network namespace: ip link set lo up)"
            ) from exc

    def _connect_async(self) -> None:
        kwargs: dict[str, Any] = {}
        if self.protocol == "5":
            props = Properties(PacketTypes.CONNECT)
            # The protocol's largest window: Mosquitto 2.0 keeps the messages beyond a client's window in a queue
            # that later messages overtake (out of order on one topic), and after the first acknowledgement sends
            # past the window anyway. The inbox holds the network thread instead when it is full (TCP backpressure).
            props.ReceiveMaximum = 65535
            props.MaximumPacketSize = self._cap
            # The broker keeps the session (subscriptions, unacknowledged messages) this long after a connection
            # ends, so a reconnect gets again what the last connection left unacknowledged.
            props.SessionExpiryInterval = self._session_expiry_s
            kwargs = {"clean_start": paho.MQTT_CLEAN_START_FIRST_ONLY, "properties": props}
        self._client.connect_async(self.address.host, self.address.port, self._keepalive, **kwargs)

    def _wait(self, deadline: float) -> None:
        while time.monotonic() < deadline and not self._connected.is_set() and self._refused is None:
            self._connected.wait(0.02)

    def _give_back(self, session: Session) -> bool:
        """End the connection of ``session`` (on its network thread) without acknowledging what it delivered but not
        yet handled, and reconnect to the kept session; False on MQTT 3.1.1, whose sessions here are clean."""
        if self.protocol != "5":
            return False
        if not session.given_back:
            session.given_back = True
            if session.current and not self._closing:
                # A clean DISCONNECT: the broker keeps the session and publishes no Will (this member is busy, not
                # gone). paho's loop then ends; _handle_disconnect starts it again.
                self._restarting = True
                self._client.disconnect()
        return True

    def _restart(self) -> None:
        """Reconnect after _give_back's DISCONNECT, from a thread of its own (paho's loop thread has ended)."""
        with self._restart_lock:
            self._client.loop_stop()
            if self._closing:
                return
            self._restarting = False
            self._connect_async()  # clean start only on the first connection: this one resumes the session
            self._client.loop_start()

    def _stop_client(self) -> None:
        self._connected.clear()
        self._net_thread = None  # a thread ended on purpose is not a dead network loop
        try:
            if self.protocol == "5":
                # Ended on purpose, the session goes too: the broker would otherwise keep collecting messages for a
                # subscriber that is not coming back.
                props = Properties(PacketTypes.DISCONNECT)
                props.SessionExpiryInterval = 0
                self._client.disconnect(properties=props)
            else:
                self._client.disconnect()
        except Exception:  # already closed: nothing to undo
            pass
        with self._restart_lock:
            self._client.loop_stop()

    @_guarded
    def _handle_connect(self, client: paho.Client, _userdata: object, _flags: object, reason_code: object,
                        properties: object) -> None:
        code = getattr(reason_code, "value", reason_code)
        if code != 0:
            self._refused = int(code)  # type: ignore[arg-type]
            log.warning("broker %s refused the connection: %s", self.url, reason_code)
            if self._refused in _UNSUPPORTED_PROTOCOL:
                client.disconnect()  # stop paho retrying with a protocol the broker will never accept
            return
        self.broker_max_packet = getattr(properties, "MaximumPacketSize", None)
        self._session = Session(self, bool(getattr(_flags, "session_present", False)) and self.connects > 0)
        self.connects += 1
        with self._sub_lock:
            subs = list(self._subscriptions.items())
        if subs:
            client.subscribe(subs)
        self._connected.set()
        if self.connects > 1:
            log.info("reconnected to %s (connection #%d); resubscribed %d filters", self.url, self.connects, len(subs))
        if self._on_connected is not None:
            self._on_connected()

    @_guarded
    def _handle_disconnect(self, _client: paho.Client, _userdata: object, _flags: object, reason_code: object,
                           _properties: object) -> None:
        self._connected.clear()
        if self._restarting:
            self._net_thread = None  # ended on purpose, started again at once
            threading.Thread(target=self._restart, name="mqtt-restart", daemon=True).start()
        elif not self._closing:
            log.warning("lost the connection to %s (%s); paho reconnects", self.url, reason_code)

    def _handle_message(self, _client: paho.Client, _userdata: object, msg: paho.MQTTMessage) -> None:
        """paho's on_message, for what its own path reads (MQTT 3.1.1)."""
        self._deliver(msg._topic, msg.payload, msg.qos, bool(msg.retain), bool(msg.dup), msg.mid)  # noqa: SLF001

    def _deliver(self, topic: bytes, payload: bytes | memoryview, qos: int, retain: bool, dup: bool,
                 mid: int) -> None:
        session = self._session
        if session.given_back:
            return  # read after its connection was given back: the broker sends it again, after the earlier ones
        inbound: InboundMessage | None = None
        try:
            # A topic that is not UTF-8 raises here: a hostile publisher's topic must not end the network thread.
            inbound = InboundMessage(topic.decode(), payload, qos, retain, dup, mid=mid, session=session)
            if self._on_message is not None:
                self._on_message(inbound)
                return
        except Exception:  # noqa: BLE001 - the last guard of the network thread
            _limited.log(logging.ERROR, "callback:_handle_message", "a message from %s could not be queued",
                         self.url, exc_info=True)
        try:
            if inbound is not None:
                inbound.ack()
            elif qos > 0:
                session.ack(mid, qos)
        except Exception:  # noqa: BLE001 - the connection is going away; nothing to acknowledge on
            pass

    @_guarded
    def _handle_socket_open(self, _client: paho.Client, _userdata: object, sock: socket.socket) -> None:
        self._net_thread = threading.current_thread()
        if self._socket_opened_at is None:
            self._socket_opened_at = time.monotonic()
        # Without TCP_NODELAY a QoS 1 round trip takes 40-88 ms instead of 0.24 ms (research/mqtt-stack.md §1.6).
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # unix sockets have no Nagle
            pass

    @_guarded
    def _handle_publish(self, _client: paho.Client, _userdata: object, mid: int, reason_code: object = None,
                        _properties: object = None) -> None:
        self._progress.set()
        with self._sub_lock:
            topic, watched = self._inflight.pop(mid, ("?", None))
        if watched is not None:
            if getattr(reason_code, "value", 0) == NO_MATCHING_SUBSCRIBERS:
                self._unheard.unheard(watched)
            elif watched.probe:
                self._unheard.heard(watched.topic)
        if not getattr(reason_code, "is_failure", False):
            return
        why = str(reason_code)
        with self._sub_lock:
            self._refusals[mid] = why
            while len(self._refusals) > _REMEMBERED_REFUSALS:
                self._refusals.popitem(last=False)
        _limited.warning("publish_refused", "the broker at %s refused a message on %s (%s); user %r may not write "
                         "there (`edgeswarm topics` says who writes what)", self.url, topic[:256], why,
                         self.credentials.username)
        if self._on_refused is not None:
            self._on_refused(mid, why)

    @_guarded
    def _handle_subscribe(self, _client: paho.Client, _userdata: object, mid: int, reason_codes: object = None,
                          *_rest: object) -> None:
        failed = [str(c) for c in (reason_codes if isinstance(reason_codes, list) else [])
                  if getattr(c, "is_failure", False)]
        with self._sub_lock:
            if failed:
                self._refused_subscriptions[mid] = ", ".join(failed)
                if len(self._refused_subscriptions) > _REMEMBERED_REFUSALS:
                    self._refused_subscriptions.pop(next(iter(self._refused_subscriptions)))
            event = self._subacks.get(mid)
            if event is None:  # the SUBACK beat subscribe() to registering its wait
                event = self._early_subacks[mid] = threading.Event()
                if len(self._early_subacks) > 1024:  # resubscriptions after reconnects are never waited on
                    self._early_subacks.pop(next(iter(self._early_subacks)))
        event.set()


class _PackedProperties(Properties):
    """PUBLISH properties packed once by publish_properties; paho only ever calls pack() on them.

    Building paho's Properties attribute by attribute and packing it twice (size check, send) cost
    about 0.1 ms per message, a third of a QoS 1 round trip.
    """

    def __init__(self, packed: bytes) -> None:  # noqa: D107 - paho's __init__ (30 us of tables) is skipped
        object.__setattr__(self, "packetType", PacketTypes.PUBLISH)  # Properties.__setattr__ only admits names
        object.__setattr__(self, "_packed", packed)

    def pack(self) -> bytes:
        return self._packed  # type: ignore[no-any-return]

    def __str__(self) -> str:
        return f"<{len(self._packed)} bytes of packed properties>"


def publish_properties(options: PublishOptions | None) -> bytes:
    """The MQTT 5 PUBLISH properties mirroring an envelope, packed (length varint first).

    MessageExpiryInterval (whole seconds, at least 1), ResponseTopic and CorrelationData (the
    correlation id's UTF-8 bytes) carry the envelope fields MQTT 5 has a property for, and one user
    property ``edgeswarm`` the rest when ``options.envelope`` is set. One property more would cost every
    receiving paho client about 10 microseconds to parse, so nothing else is sent.
    """
    buf = bytearray()
    if options is not None:
        if options.expires_in_s is not None:
            # The property is a four-byte integer: a reply to a request that says it expires in a thousand years
            # gets the longest interval MQTT can say, rather than a struct.error in the handler that replies.
            expiry = max(1, math.ceil(min(_MAX_EXPIRY_S, options.expires_in_s)))
            buf += b"\x02" + struct.pack("!I", expiry)
        if options.reply_to:
            buf += b"\x08" + _utf8(options.reply_to.encode())
        if options.correlation_id:
            buf += b"\x09" + _utf8(options.correlation_id.encode())
        if options.envelope:
            buf += b"\x26" + _ENVELOPE_KEY + _utf8(options.envelope.encode())
    return _varint(len(buf)) + bytes(buf)


# What MQTT brokers refuse in a topic name (Mosquitto disconnects the client): wildcards, control characters and
# Unicode noncharacters.
_BAD_TOPIC_CHARS = re.compile("[+#\x00-\x1f\x7f-\x9f\ufdd0-\ufdef"
                              + "".join(f"{chr(p * 0x10000 + 0xFFFE)}{chr(p * 0x10000 + 0xFFFF)}" for p in range(17))
                              + "]")


def unreachable_reason(host: str, port: int, timeout_s: float = 2.0) -> str | None:
    """Why no TCP connection to ``host:port`` can be made (the name does not resolve, nothing listens there, no
    route), or None when one can be made now or the attempt merely timed out after ``timeout_s`` seconds."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return f"the host name {host!r} does not resolve"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except ConnectionRefusedError:
        return f"nothing listens on port {port} of {host} (connection refused)"
    except TimeoutError:
        return None
    except OSError as exc:
        return exc.strerror or str(exc)


def topic_problem(topic: str) -> str | None:
    """Why a broker would refuse ``topic`` in a PUBLISH, or None if it is a valid topic name."""
    # Checked on every publish, and a sender uses the same few topics over and over: short ones are remembered.
    return _remembered_topic_problem(topic) if len(topic) <= 256 else _topic_problem(topic)


def _topic_problem(topic: str) -> str | None:
    if not topic:
        return "a topic is never empty"
    bad = _BAD_TOPIC_CHARS.search(topic)
    if bad is not None:
        return f"a topic holds no wildcard, control character or noncharacter (U+{ord(bad.group()):04X})"
    try:
        size = len(topic.encode())
    except UnicodeEncodeError:
        return "a topic is valid UTF-8 (this one holds a lone surrogate)"
    return f"a topic is at most 65535 bytes (this one is {size})" if size > 65535 else None


_remembered_topic_problem = functools.lru_cache(maxsize=4096)(_topic_problem)


def _utf8(data: bytes) -> bytes:
    return struct.pack("!H", len(data)) + data


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, byte = divmod(n, 128)
        out.append(byte | (128 if n else 0))
        if not n:
            return bytes(out)


def packet_size(topic: str, payload_len: int, qos: int, props: Properties | None) -> int:
    """Bytes of the PUBLISH packet for these parts (fixed header, topic, packet id, properties, payload)."""
    remaining = 2 + len(topic.encode()) + (2 if qos > 0 else 0) + payload_len
    if props is not None:
        remaining += len(props.pack())
    length_bytes = 1 if remaining < 128 else 2 if remaining < 16384 else 3 if remaining < 2097152 else 4
    return 1 + length_bytes + remaining


_ENVELOPE_KEY = _utf8(b"edgeswarm")
_MAX_EXPIRY_S = 2**32 - 1  # the largest Message Expiry Interval (seconds) an MQTT 5 property can carry


class RawPeer:
    """Bare paho for baselines only (``edgeswarm bench collectives``): publishes raw payloads and counts what
    arrives on one topic, nothing encoded, decoded, checked or handed to another thread.

    It is what the bus does per message with everything of edgeswarm's taken away, so a benchmark can put the bus
    next to it in the same run: MQTT 5, clean start, TCP_NODELAY, QoS 1 with the same send window
    (``window_messages`` unacknowledged messages at most; ``publish`` waits for room), acknowledged by paho on its
    network thread as each message arrives. Not for anything but measurements: it validates nothing.
    """

    def __init__(self, url: str, client_id: str, topic: str, *, window_messages: int = 32,
                 timeout_s: float = 10.0) -> None:
        address = parse_broker_url(url)
        self._window = window_messages
        self._received = 0
        self._arrived = threading.Condition()
        self._progress = threading.Event()
        self._client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
        self._client.max_inflight_messages_set(window_messages)
        self._client.max_queued_messages_set(window_messages)
        self._client.on_socket_open = self._socket_open
        self._client.on_message = self._message
        self._client.on_publish = self._published
        connected = threading.Event()
        self._client.on_connect = lambda *_args: connected.set()
        self._client.connect(address.host, address.port, keepalive=30, clean_start=True)
        self._client.loop_start()
        if not connected.wait(timeout_s):
            self.close()
            raise BrokerUnavailableError(f"the raw baseline client could not connect to {url}")
        subscribed = threading.Event()
        self._client.on_subscribe = lambda *_args: subscribed.set()
        self._client.subscribe(topic, qos=1)
        if not subscribed.wait(timeout_s):
            self.close()
            raise BrokerUnavailableError(f"the broker at {url} did not confirm the raw baseline's subscription")

    @property
    def received(self) -> int:
        """Messages that arrived on this peer's topic so far."""
        with self._arrived:
            return self._received

    def publish(self, topic: str, payload: bytes, timeout_s: float = 30.0) -> None:
        """Publish ``payload`` at QoS 1, waiting up to ``timeout_s`` seconds for room in the send window."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._progress.clear()
            info = self._client.publish(topic, payload, qos=1)
            if info.rc != MQTTErrorCode.MQTT_ERR_QUEUE_SIZE:
                return
            if time.monotonic() >= deadline:
                raise PublishTimeoutError(f"the raw baseline's window of {self._window} stayed full")
            self._progress.wait(0.02)

    def wait_received(self, count: int, timeout_s: float) -> bool:
        """Wait until ``count`` messages in all have arrived; False if they did not within ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while self._received < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._arrived.wait(left)
        return True

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()

    def _socket_open(self, _client: paho.Client, _userdata: object, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _message(self, _client: paho.Client, _userdata: object, _msg: paho.MQTTMessage) -> None:
        with self._arrived:
            self._received += 1
            self._arrived.notify_all()

    def _published(self, *_args: object) -> None:
        self._progress.set()
