"""Logging with the node and the service in every record."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable


class _ContextFilter(logging.Filter):
    def __init__(self, node: str, service: str) -> None:
        super().__init__()
        self.node = node
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.node = getattr(record, "node", self.node)
        record.service = getattr(record, "service", self.service)
        return True


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "node": getattr(record, "node", "-"),
            "service": getattr(record, "service", "-"),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


TEXT_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-7s [%(node)s/%(service)s] %(name)s: %(message)s"


def configure_logging(node: str, service: str, level: str = "INFO", as_json: bool = False) -> None:
    """Send every log record to stderr stamped with ``node`` and ``service``; replaces earlier handlers."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter(node, service))
    if as_json:
        handler.setFormatter(_JsonFormatter())
    else:
        formatter = logging.Formatter(TEXT_FORMAT, datefmt="%Y-%m-%dT%H:%M:%S")
        formatter.converter = time.localtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


class RateLimitedLog:
    """Logs at most ``burst`` lines per key per ``window_s`` seconds, then one summary line.

    For lines an outsider can trigger (a rejected message, a refused member): a flood must not turn into a
    flood of log lines. The summary (how many ``what`` were left out) is written when the key is next used
    after its window. ``clock`` is any monotonic clock in seconds. Thread-safe.
    """

    def __init__(self, logger: logging.Logger, *, burst: int = 10, window_s: float = 10.0, what: str = "lines",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._burst = burst
        self._window = window_s
        self._what = what
        self._clock = clock
        self._state: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        """Log ``msg % args`` at ``level`` unless ``key`` has had ``burst`` lines in its current window."""
        now = self._clock()
        with self._lock:
            start, n = self._state.get(key, (now, 0))
            if now - start > self._window:
                if n > self._burst:
                    self._log.log(level, "... %d more '%s' %s in the last %.0f s", n - self._burst, key, self._what,
                                  self._window)
                start, n = now, 0
            self._state[key] = (start, n + 1)
        if n < self._burst:
            self._log.log(level, msg, *args)

    def warning(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def error(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.ERROR, key, msg, *args)
