"""Calls run one after another on one long-lived thread: a stage's rounds, a peer's sends (``runtime.outbox``).

A computing thread's first calls cost more than its later ones (the allocator's arena and torch's per-thread state
are new): MobileNetV2's forward and backward at 3 samples took 2% to 4% more CPU on a fresh thread each round than
on one thread for every round, and an emulated device multiplies that by its slow-down. So a stage's rounds share
one thread. It starts with the first call and ends after ``idle_s`` without one, so a stage that is dropped or
replaced leaves no thread behind for long, and nothing has to close it; ``close`` ends it sooner, once what is
queued has run.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

IDLE_S = 30.0


class SerialThread:
    """Runs ``submit``ted calls in order on one daemon thread named ``name`` while it runs one (``idle_name``
    while it waits for the next)."""

    def __init__(self, name: str, idle_s: float = IDLE_S) -> None:
        self.name = name
        self.idle_name = f"{name}-idle"
        self.idle_s = idle_s
        # None: end the thread once nothing else is queued (``close``).
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards ``_thread`` against a thread that is just ending
        self._thread: threading.Thread | None = None  # the running thread, if any

    def submit(self, call: Callable[[], None]) -> None:
        """Queue ``call``; it runs after every call queued before it. Exceptions it raises are logged, never
        raised here: a caller that must hear of a failure catches it in ``call``."""
        with self._lock:
            self._calls.put(call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Run what is queued, then end the thread, waiting at most ``timeout_s`` seconds for both."""
        with self._lock:
            thread = self._thread
            if thread is None:
                return
            self._calls.put(None)
        thread.join(timeout_s)

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            me.name = self.idle_name
            try:
                call = self._calls.get(timeout=self.idle_s)
            except queue.Empty:
                call = None
            if call is None:
                with self._lock:
                    if self._calls.empty():
                        self._thread = None
                        return
                continue
            me.name = self.name
            try:
                call()
            except Exception:  # noqa: BLE001 - one failed call must not end the calls queued after it
                log.exception("a call on thread %s failed", self.name)
