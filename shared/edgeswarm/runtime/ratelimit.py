"""Rate-limited logging for lines that someone outside the service can trigger (refused or failed requests):
a flood of bad requests must not become a flood of log lines."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLog:
    """Logs at most ``burst`` lines per key in each window of ``window_s`` seconds to ``logger``; the first line
    of the next window says how many lines of that key were left out. Thread-safe.

    Keys must come from a small fixed set (a failure reason), never from a request: each key is remembered."""

    def __init__(self, logger: logging.Logger, *, burst: int = 10, window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._burst = burst
        self._window_s = window_s
        self._clock = clock
        self._state: dict[str, tuple[float, int]] = {}  # key -> (window start, lines asked for in it)
        self._lock = threading.Lock()

    def log(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        """Log ``msg % args`` at ``level`` unless ``key`` has used up its lines in the current window."""
        now = self._clock()
        left_out = 0
        with self._lock:
            start, count = self._state.get(key, (now, 0))
            if now - start > self._window_s:
                left_out = max(0, count - self._burst)
                start, count = now, 0
            self._state[key] = (start, count + 1)
        if left_out:
            self._logger.log(level, "... %d more '%s' lines were left out in %.0f s", left_out, key, self._window_s)
        if count < self._burst:
            self._logger.log(level, msg, *args, exc_info=exc_info)

    def warning(self, key: str, msg: str, *args: object) -> None:
        """``log`` at WARNING."""
        self.log(logging.WARNING, key, msg, *args)
