"""The raw-TCP baseline's receiver, run as its own process by ``edgeswarm bench transport``.

Protocol (one connection per run): the sender writes ``u64 count, u64 size`` and then ``count``
messages of ``u32 length + bytes``; the sink reads them into one preallocated buffer and answers one
byte when all have arrived. It prints its port on stdout, then serves until killed.
"""

from __future__ import annotations

import socket
import struct
import sys

RUN_HEADER = struct.Struct("<QQ")
LENGTH = struct.Struct("<I")
MAX_MESSAGE_BYTES = 1 << 30


def _read_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("sender closed the connection early")
        got += n


def serve(host: str = "127.0.0.1") -> None:
    """Accept runs forever on a free port of ``host``; the port is printed first."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, 0))
    srv.listen(4)
    print(srv.getsockname()[1], flush=True)
    head = bytearray(RUN_HEADER.size)
    length = bytearray(LENGTH.size)
    while True:
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                _read_exact(conn, memoryview(head))
                count, size = RUN_HEADER.unpack(head)
                if size > MAX_MESSAGE_BYTES:
                    raise ConnectionError(f"message size {size} exceeds {MAX_MESSAGE_BYTES}")
                buf = memoryview(bytearray(size))
                for _ in range(count):
                    _read_exact(conn, memoryview(length))
                    _read_exact(conn, buf[: LENGTH.unpack(length)[0]])
                conn.sendall(b"\x01")
            except (ConnectionError, OSError) as exc:
                print(f"tcp sink: {exc}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    serve()
