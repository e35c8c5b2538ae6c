"""Logging with the node and the service in every record."""

from __future__ import annotations

import json
import logging
import sys
import time


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
