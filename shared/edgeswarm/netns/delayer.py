"""A delay line for packets, in user space: the kernel hands each packet of an nft ``queue`` rule to this process
(NFQUEUE, over a raw netlink socket) and it gives the verdict ``accept`` only once the packet's delay has passed.

Why it exists: this machine's kernel (and CI's) has no ``sch_netem``, so ``tc`` cannot delay packets; nftables can
queue them to user space. Only the packet's id crosses to us (copy mode META, no payload), and one
NFQNL_MSG_VERDICT_BATCH accepts every id up to N, which fits a FIFO delay line: jitter is drawn per packet but a
packet is never released before the one queued ahead of it (no reordering, like netem's default with rate).

Run inside a namespace as ``python -m edgeswarm.netns.delayer --config FILE --netns NAME --owner PID``. The config
file (a :class:`DelayerConfig` as JSON) maps queue numbers to delays; SIGHUP re-reads it (queues are bound and
unbound to match), SIGTERM/SIGINT stop it. It stops by itself when the owner process exits or the named network
namespace is deleted, so a crashed owner never leaves it behind. The queues are bound with FAIL_OPEN and the nft
rules with ``bypass``: when the queue is full or this process is gone, packets pass undelayed instead of dropped.
"""

from __future__ import annotations

import argparse
import collections
import errno
import logging
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2
NFQNL_MSG_VERDICT_BATCH = 3
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_CFG_CMD_UNBIND = 2
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN = 0x1
NFQA_CFG_F_GSO = 0x4  # queue GSO packets whole instead of the kernel segmenting each 64 KB packet for us
NF_ACCEPT = 1
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLA_TYPE_MASK = 0x3FFF  # strips NLA_F_NESTED and NLA_F_NET_BYTEORDER

QUEUE_MAXLEN = 4096  # packets held per queue; beyond it FAIL_OPEN lets packets through undelayed
RCVBUF = 4 << 20
WATCH_PERIOD_S = 0.5  # how often the owner and the namespace are checked
MAX_DELAY_S = 60.0
REALTIME_PRIORITY = 10  # SCHED_FIFO, low among real-time tasks (kernel threads use 50)
LOG_EVERY_S = 10.0  # rate limit for warnings about odd messages


class QueueDelay(BaseModel):
    """The delay of one NFQUEUE queue: each packet is held ``delay_s`` plus a uniform draw in
    [-``jitter_s``, +``jitter_s``] (never below zero, never before the packet ahead of it), in seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    delay_s: float = Field(ge=0, le=MAX_DELAY_S)
    jitter_s: float = Field(default=0, ge=0, le=MAX_DELAY_S)


class DelayerConfig(BaseModel):
    """What the delayer does: queue number (0..65535) -> its delay; ``seed`` seeds the jitter draws."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    queues: dict[int, QueueDelay] = Field(default_factory=dict)
    seed: int = 0
    generation: int = 0  # written to CONFIG.applied once this configuration is in force


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * ((4 - length % 4) % 4)


def nfq_message(msg: int, queue: int, attrs: bytes, *, seq: int = 0, ack: bool = False) -> bytes:
    """One nfnetlink_queue message: nlmsghdr, nfgenmsg (AF_UNSPEC, version 0, queue number big-endian), attrs."""
    body = struct.pack("!BBH", socket.AF_UNSPEC, 0, queue) + attrs
    flags = NLM_F_REQUEST | (NLM_F_ACK if ack else 0)
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, flags, seq, 0) + body


def bind_messages(queue: int, *, seq: int) -> list[bytes]:
    """The config messages that bind ``queue`` to this socket: BIND, copy META (no payload), a max length, and
    FAIL_OPEN + GSO (a full queue lets packets pass; 64 KB GSO packets are queued whole)."""
    flags = NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO
    return [
        nfq_message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0)),
                    seq=seq, ack=True),
        nfq_message(NFQNL_MSG_CONFIG, queue,
                    _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
                    + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))
                    + _attr(NFQA_CFG_MASK, struct.pack("!I", flags)) + _attr(NFQA_CFG_FLAGS, struct.pack("!I", flags)),
                    seq=seq + 1, ack=True),
    ]


def unbind_message(queue: int, *, seq: int) -> bytes:
    return nfq_message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_UNBIND, 0)),
                       seq=seq, ack=True)


def verdict_batch(queue: int, up_to_id: int) -> bytes:
    """Accept every packet of ``queue`` with an id up to ``up_to_id`` (ids grow in arrival order)."""
    return nfq_message(NFQNL_MSG_VERDICT_BATCH, queue, _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, up_to_id)))


def parse_packets(data: bytes) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """Split one recv() of netlink messages into (queue, packet id) pairs of queued packets and the acknowledgements
    (sequence number -> errno, 0 = success). Malformed or foreign messages are skipped, never raised."""
    packets: list[tuple[int, int]] = []
    errors: dict[int, int] = {}
    offset = 0
    while offset + 16 <= len(data):
        length, kind, _flags, seq, _pid = struct.unpack_from("=IHHII", data, offset)
        if length < 16 or offset + length > len(data):
            break
        end = offset + length
        if kind == NLMSG_ERROR and length >= 20:
            errors[seq] = -struct.unpack_from("=i", data, offset + 16)[0]
        elif kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET and length >= 20:
            queue = struct.unpack_from("!H", data, offset + 18)[0]
            pos = offset + 20
            while pos + 4 <= end:
                alen, atype = struct.unpack_from("=HH", data, pos)
                if alen < 4 or pos + alen > end:
                    break
                if atype & NLA_TYPE_MASK == NFQA_PACKET_HDR and alen >= 8:
                    packets.append((queue, struct.unpack_from("!I", data, pos + 4)[0]))
                    break
                pos += (alen + 3) & ~3
        offset += (length + 3) & ~3
    return packets, errors


class DelayLine:
    """The FIFO of one queue: packet ids with their release times (monotonic seconds), kept in arrival order."""

    def __init__(self, delay: QueueDelay, rng: random.Random) -> None:
        self.delay = delay
        self._rng = rng
        self._held: collections.deque[tuple[float, int]] = collections.deque()
        self._last_release = 0.0

    def add(self, packet_id: int, now: float) -> None:
        hold = self.delay.delay_s
        if self.delay.jitter_s > 0:
            hold = max(0.0, hold + self._rng.uniform(-self.delay.jitter_s, self.delay.jitter_s))
        self._last_release = max(now + hold, self._last_release)
        self._held.append((self._last_release, packet_id))

    def due(self, now: float) -> int | None:
        """Pop every packet whose time has come; return the highest id popped (None when none)."""
        last = None
        while self._held and self._held[0][0] <= now:
            last = self._held.popleft()[1]
        return last

    def next_release(self) -> float | None:
        return self._held[0][0] if self._held else None

    def __len__(self) -> int:
        return len(self._held)


class Delayer:
    """Binds the configured queues on one netlink socket and holds their packets' verdicts."""

    def __init__(self, config_path: Path, *, netns: str | None, owner: int | None) -> None:
        self.config_path = config_path
        self.netns = netns
        self.owner = owner
        self.lines: dict[int, DelayLine] = {}
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        try:
            self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        except OSError:
            pass  # an overflow then reads as ENOBUFS, handled in _receive
        self.sock.bind((0, 0))
        self.sock.setblocking(False)
        self._seq = 1
        self._reload_wanted = True
        self._stop = False
        self._last_warning = 0.0
        self._own_netns = os.stat("/proc/self/ns/net").st_ino
        self._owner_fd = self._watch_owner(owner)
        self.released = 0  # verdict batches sent
        self.packets = 0  # packets queued to us
        # A signal wakes the select at once (SIGHUP's reload should not wait for the next timeout).
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    @staticmethod
    def _watch_owner(owner: int | None) -> int | None:
        if owner is None:
            return None
        try:
            return os.pidfd_open(owner)
        except (OSError, AttributeError):
            return None  # gone already (checked again in _should_stop) or no pidfd on this kernel

    def request_reload(self, *_: object) -> None:
        self._reload_wanted = True

    def request_stop(self, *_: object) -> None:
        self._stop = True

    def _warn(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_warning >= LOG_EVERY_S:
            self._last_warning = now
            log.warning(message, *args)

    def _send(self, message: bytes) -> None:
        try:
            self.sock.send(message)
        except OSError as exc:
            self._warn("netlink send failed: %s", exc)

    def _config_call(self, messages: list[bytes]) -> list[int]:
        """Send config messages with ACK and return their errnos (0 = done; ETIMEDOUT when no answer came).
        Packets read meanwhile are queued as usual."""
        seqs = [struct.unpack_from("=I", m, 8)[0] for m in messages]
        for message in messages:
            self._send(message)
        acks: dict[int, int] = {}
        deadline = time.monotonic() + 2.0
        while any(s not in acks for s in seqs) and time.monotonic() < deadline:
            ready, _, _ = select.select([self.sock], [], [], 0.1)
            if ready:
                acks.update(self._receive())
        return [acks.get(s, errno.ETIMEDOUT) for s in seqs]

    def reload(self) -> None:
        self._reload_wanted = False
        try:
            config = DelayerConfig.model_validate_json(self.config_path.read_text())
        except (OSError, ValidationError, ValueError) as exc:
            log.warning("delayer config %s unreadable, keeping the old one: %s", self.config_path, exc)
            return
        rng = random.Random(config.seed)
        failed = False
        for queue in [q for q in self.lines if q not in config.queues]:
            line = self.lines.pop(queue)
            last = line.due(float("inf"))
            if last is not None:
                self._send(verdict_batch(queue, last))
            self._config_call([unbind_message(queue, seq=self._next_seq(1))])
        for queue, delay in config.queues.items():
            if queue in self.lines:
                self.lines[queue].delay = delay
                continue
            errors = self._config_call(bind_messages(queue, seq=self._next_seq(2)))
            if any(errors):
                log.error("binding NFQUEUE %d failed: %s", queue, [os.strerror(e) for e in errors if e])
                failed = True
                continue
            self.lines[queue] = DelayLine(delay, rng)
        log.info("delaying queues %s", {q: (d.delay_s, d.jitter_s) for q, d in config.queues.items()})
        if failed:
            return
        try:
            self.config_path.with_suffix(".applied").write_text(str(config.generation))
        except OSError as exc:
            log.warning("cannot record the applied configuration: %s", exc)

    def _next_seq(self, count: int) -> int:
        seq = self._seq
        self._seq += count
        return seq

    def _receive(self) -> dict[int, int]:
        """Read everything the socket holds; queue the packets, return the acknowledgements (seq -> errno)."""
        errors: dict[int, int] = {}
        now = time.monotonic()
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return errors
            except OSError as exc:
                # ENOBUFS: the kernel dropped messages for us; their packets stay queued and the next batch
                # verdict of that queue accepts them.
                self._warn("netlink receive: %s", exc)
                return errors
            packets, acks = parse_packets(data)
            errors.update(acks)
            self.packets += len(packets)
            for queue, packet_id in packets:
                line = self.lines.get(queue)
                if line is None:
                    self._send(verdict_batch(queue, packet_id))
                else:
                    line.add(packet_id, now)

    def _release_due(self) -> float | None:
        now = time.monotonic()
        soonest = None
        for queue, line in self.lines.items():
            last = line.due(now)
            if last is not None:
                self._send(verdict_batch(queue, last))
                self.released += 1
            nxt = line.next_release()
            if nxt is not None and (soonest is None or nxt < soonest):
                soonest = nxt
        return soonest

    def _should_stop(self) -> bool:
        if self._stop:
            return True
        if self.owner is not None:
            if self._owner_fd is not None:
                if select.select([self._owner_fd], [], [], 0)[0]:
                    log.info("owner %d exited: stopping", self.owner)
                    return True
            elif not Path(f"/proc/{self.owner}").exists():
                log.info("owner %d exited: stopping", self.owner)
                return True
        if self.netns is not None:
            try:
                if os.stat(f"/run/netns/{self.netns}").st_ino != self._own_netns:
                    raise FileNotFoundError
            except OSError:
                log.info("namespace %s is gone: stopping", self.netns)
                return True
        return False

    def run(self) -> int:
        next_watch = 0.0
        while True:
            now = time.monotonic()
            if self._stop:
                break
            if now >= next_watch:
                next_watch = now + WATCH_PERIOD_S
                if self._should_stop():
                    break
            if self._reload_wanted:
                self.reload()
            soonest = self._release_due()
            timeout = WATCH_PERIOD_S if soonest is None else max(0.0, min(soonest - time.monotonic(), WATCH_PERIOD_S))
            try:
                ready, _, _ = select.select([self.sock, self._wake_r], [], [], timeout)
            except InterruptedError:
                continue
            if self._wake_r in ready:
                try:
                    self._wake_r.recv(4096)
                except OSError:
                    pass
            if self.sock in ready:
                self._receive()
        self.close()
        return 0

    def close(self) -> None:
        log.info("stopping: %d packets delayed, %d verdict batches", self.packets, self.released)
        for queue, line in self.lines.items():
            last = line.due(float("inf"))
            if last is not None:
                self._send(verdict_batch(queue, last))
        self.sock.close()
        if self._owner_fd is not None:
            os.close(self._owner_fd)


def _realtime() -> None:
    # A delay line must wake on time: on a loaded machine an ordinary process waits for a time slice at each of
    # its two wake-ups per packet (arrival, release), which added about 7 ms to a 20 ms round trip with two busy
    # loops on two cores. A low real-time priority wakes it at once; the work per wake-up is tiny, and the
    # kernel's real-time throttling bounds it anyway. Without the privilege it runs as it is.
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
    except (OSError, AttributeError) as exc:
        log.info("no real-time priority (%s): delays may stretch on a loaded machine", exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgeswarm.netns.delayer", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="DelayerConfig JSON; re-read on SIGHUP")
    parser.add_argument("--netns", help="stop when /run/netns/NAME no longer names this process's namespace")
    parser.add_argument("--owner", type=int, help="stop when this process exits")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s delayer %(levelname)s %(message)s")
    _realtime()
    delayer = Delayer(args.config, netns=args.netns, owner=args.owner)
    signal.set_wakeup_fd(delayer._wake_w.fileno(), warn_on_full_buffer=False)
    signal.signal(signal.SIGHUP, delayer.request_reload)
    signal.signal(signal.SIGTERM, delayer.request_stop)
    signal.signal(signal.SIGINT, delayer.request_stop)
    return delayer.run()


if __name__ == "__main__":
    sys.exit(main())
