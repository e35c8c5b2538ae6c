"""Link measurements for the namespace tests, run as a script inside a namespace (``ip netns exec NS python
tests/netns_probe.py ...``): a TCP sink that reports the received rate per interval, a TCP echo for round trips,
a UDP counter, and their clients. Every result is one JSON line on stdout; servers print ``ready`` first."""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

INTERVAL_S = 0.2
WARMUP_S = 0.5  # HTB's first burst and TCP's slow start are left out of the rate


def _listen(kind: int, host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    if kind == socket.SOCK_STREAM:
        sock.listen(1)
    print("ready", flush=True)
    return sock


def sink(host: str, port: int, timeout: float) -> dict[str, object]:
    """Receive one connection until EOF; the received rate (bytes/s) of each interval after the warm-up."""
    server = _listen(socket.SOCK_STREAM, host, port)
    server.settimeout(timeout)
    conn, _ = server.accept()
    conn.settimeout(timeout)
    start = time.monotonic()
    marks: list[tuple[float, int]] = []
    total = 0
    while True:
        data = conn.recv(1 << 20)
        if not data:
            break
        total += len(data)
        marks.append((time.monotonic() - start, total))
    rates = []
    edge, base = WARMUP_S, None
    for t, count in marks:
        if t < WARMUP_S:
            base = count
            continue
        if t >= edge + INTERVAL_S and base is not None:
            rates.append((count - base) / (t - edge))
            edge, base = t, count
    return {"total": total, "rates": rates}


def send(host: str, port: int, seconds: float) -> dict[str, object]:
    sock = socket.create_connection((host, port), timeout=10)
    chunk = b"x" * (1 << 16)
    sent = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sent += sock.send(chunk)
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)
    sock.close()
    return {"sent": sent}


def echo(host: str, port: int, timeout: float) -> dict[str, object]:
    server = _listen(socket.SOCK_STREAM, host, port)
    server.settimeout(timeout)
    conn, _ = server.accept()
    conn.settimeout(timeout)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        data = conn.recv(4096)
        if not data:
            return {}
        conn.sendall(data)


def ping(host: str, port: int, count: int) -> dict[str, object]:
    """The median round trip (seconds) of ``count`` 64-byte exchanges over one TCP connection."""
    sock = socket.create_connection((host, port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(count + 3):
        start = time.monotonic()
        sock.sendall(b"p" * 64)
        got = 0
        while got < 64:
            got += len(sock.recv(64 - got))
        rtts.append(time.monotonic() - start)
        time.sleep(0.01)
    sock.close()
    return {"median_s": statistics.median(rtts[3:]), "rtts": rtts[3:]}


def udp_count(host: str, port: int, idle: float) -> dict[str, object]:
    """Count datagrams until ``idle`` seconds pass without one (after the first)."""
    sock = _listen(socket.SOCK_DGRAM, host, port)
    sock.settimeout(10)
    count = 0
    try:
        sock.recv(2048)
        count = 1
        sock.settimeout(idle)
        while True:
            sock.recv(2048)
            count += 1
    except TimeoutError:
        pass
    return {"received": count}


def udp_send(host: str, port: int, count: int) -> dict[str, object]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    errors = 0
    for i in range(count):
        try:
            sock.sendto(i.to_bytes(4, "big") * 64, (host, port))
        except OSError:
            errors += 1
        if i % 50 == 49:
            time.sleep(0.002)  # paced, so the receiver's socket buffer never overflows
    return {"sent": count, "errors": errors}


def connect(host: str, port: int, timeout: float) -> dict[str, object]:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return {"connected": True}
    except OSError as exc:
        return {"connected": False, "error": str(exc)}


def main() -> int:
    try:
        # Measure the link, not the scheduler: on a loaded machine an ordinary process waits for a time slice at
        # each wake-up (milliseconds); the delayer runs real-time for the same reason.
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(5))
    except (OSError, AttributeError):
        pass
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["sink", "send", "echo", "ping", "udp-count", "udp-send", "connect", "listen"])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("value", type=float, nargs="?", default=5.0)
    args = parser.parse_args()
    if args.mode == "listen":  # accept connections until killed
        server = _listen(socket.SOCK_STREAM, args.host, args.port)
        while True:
            server.accept()[0].close()
    modes = {"sink": sink, "send": send, "echo": echo, "ping": lambda h, p, v: ping(h, p, int(v)),
             "udp-count": udp_count, "udp-send": lambda h, p, v: udp_send(h, p, int(v)), "connect": connect}
    print(json.dumps(modes[args.mode](args.host, args.port, args.value)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
