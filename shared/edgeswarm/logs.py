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


class _OneLineFormatter(logging.Formatter):
    """``warning: message (ExceptionType: what)``: one line a user reads, never a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            text += f" ({type(exc).__name__}: {exc})"
        return text


def configure_cli_logging(level: str = "WARNING") -> None:
    """Log records of a command-line run go to stderr as one line each, without tracebacks: what a command
    receives from the network (a retained message that does not decode, a handler that fails on it) is a warning
    for the user, not a crash dump. EDGESWARM_LOG_LEVEL=DEBUG shows the tracebacks."""
    handler = logging.StreamHandler(sys.stderr)
    if level.upper() != "DEBUG":
        handler.setFormatter(_OneLineFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    known = isinstance(logging.getLevelName(level.upper()), int)
    root.setLevel(level.upper() if known else "WARNING")


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

    def log(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        """Log ``msg % args`` at ``level`` unless ``key`` has had ``burst`` lines in its current window."""
        now = self._clock()
        with self._lock:
            start, n = self._state.get(key, (now, 0))
            if now - start > self._window:
                if n > self._burst:
                    self._log.log(level, "... %d more '%s' %s in the last %.0f s", n - self._burst, key, self._what,
                                  self._window)
                start, n = now, 0
            if len(self._state) > 1024 and key not in self._state:
                self._state.clear()  # keys come from fixed sets of reasons; never let them grow without bound
            self._state[key] = (start, n + 1)
        if n < self._burst:
            self._log.log(level, msg, *args, exc_info=exc_info)

    def warning(self, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        self.log(logging.WARNING, key, msg, *args, exc_info=exc_info)

    def error(self, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        self.log(logging.ERROR, key, msg, *args, exc_info=exc_info)
