"""Turning SIGTERM and SIGINT into a threading.Event without taking locks in a signal handler.

A Python signal handler runs on the main thread between bytecodes; if it called ``Event.set()`` while
the main thread was inside ``Event.wait()`` it would deadlock on the event's own lock. Instead the
interpreter writes the signal number to a socket (``signal.set_wakeup_fd``) and a watcher thread sets
the event.
"""

from __future__ import annotations

import signal
import socket
import threading

_keep: list[socket.socket] = []  # the socket pair must outlive the call


def stop_on_signals(event: threading.Event, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Set ``event`` when one of ``signals`` arrives. Call from the main thread, once per process."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    _keep.extend((reader, writer))
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    for sig in signals:
        signal.signal(sig, lambda *_: None)  # the C-level handler does the wake-up write
    wanted = {int(s) for s in signals}

    def watch() -> None:
        while True:
            data = reader.recv(64)
            if not data or wanted.intersection(data):
                event.set()
                if not data:
                    return

    threading.Thread(target=watch, name="signal-watcher", daemon=True).start()


def terminate_as_interrupt() -> None:
    """Make SIGTERM raise KeyboardInterrupt in the main thread, as Ctrl-C does, so a command's ``finally``
    blocks (stopping a local cluster it started) run when it is terminated. Call from the main thread."""

    def interrupt(_sig: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
