"""``edgeswarm watch [TOPIC-FILTER]``: every message on the cluster's topics, decoded, as it arrives.

The readable counterpart of ``mosquitto_sub -v -t 'edgeswarm/#'``: topic, schema, sender and fields, tensors as
dtype and shape, undecodable payloads as ``<undecodable: N bytes: reason>``; ``--json`` prints one JSON object a
line. Messages are decoded on the bus's single inbox worker and printed by the main thread, so a Ctrl-C or a
reader that goes away (``| head``) ends the command at once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import queue
import signal
import time
from typing import Any

from edgeswarm.bus import RawInbound
from edgeswarm.cli.common import add_hub_arg, hub_url
from edgeswarm.cli.console import console, err_console
from edgeswarm.errors import ConfigError
from edgeswarm.runtime.client import client_bus
from edgeswarm.settings import Settings
from edgeswarm.topics import ROOT
from edgeswarm.wire.observe import Observation, Observer

DEFAULT_FILTER = f"{ROOT}/#"
# Decoded messages waiting for the terminal. Full, it holds up the bus's worker and so the broker's acknowledgements:
# a slow terminal slows the delivery instead of growing memory.
_BACKLOG = 1024
_FIELD_CHARS = 160  # one field's value in the readable form; --json prints them whole


def add_watch_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``watch`` to the subcommands."""
    p = sub.add_parser("watch", help="print every message on the cluster's topics, decoded (topic, schema, fields, "
                       "tensor shapes)")
    p.add_argument("filter", nargs="?", default=DEFAULT_FILTER, metavar="TOPIC-FILTER",
                   help=f"an MQTT topic filter (default {DEFAULT_FILTER}); `edgeswarm topics` lists the tree")
    add_hub_arg(p)
    p.add_argument("--json", action="store_true",
                   help="one JSON object a line: topic, schema, version, sender, msg_id, fields, tensor, retained, "
                   "time, sent_at, expired, error")
    p.add_argument("--count", type=int, default=0, metavar="N", help="stop after N messages (0: never)")
    p.add_argument("--timeout", type=float, default=0.0, metavar="S", help="stop after S seconds (0: never)")


def check_filter(topic_filter: str) -> None:
    """Raise ConfigError unless ``topic_filter`` is a valid MQTT subscription filter."""
    levels = topic_filter.split("/")
    problem = None
    if not topic_filter:
        problem = "it is empty"
    elif "\0" in topic_filter:
        problem = "it holds a NUL character"
    elif any("#" in level and (level != "#" or i != len(levels) - 1) for i, level in enumerate(levels)):
        problem = "'#' must be a whole level, and the last"
    elif any("+" in level and level != "+" for level in levels):
        problem = "'+' must be a whole level"
    if problem:
        raise ConfigError(f"topic filter {topic_filter!r} is not a valid MQTT filter: {problem} "
                          f"(e.g. {DEFAULT_FILTER} or {ROOT}/node/+/+/status)")


def run_watch(args: argparse.Namespace) -> int:
    check_filter(args.filter)
    # A shell starts a background command with SIGINT ignored, and Python keeps an inherited SIG_IGN: a watch started
    # with `&` (or by a script) would then never stop on Ctrl-C or `kill -INT`, its only way to end without --count.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.count < 0 or args.timeout < 0:
        raise ConfigError("--count and --timeout take 0 (never) or a positive number")
    hub = hub_url(args.hub)
    # One inbox worker: messages are observed, and so printed, in the order they arrived.
    settings = Settings(**({"hub_url": hub} if hub else {}), workers=1)
    bus = client_bus(settings, role="watch")
    observer = Observer(max_tensor_bytes=settings.max_tensor_bytes)
    backlog: queue.Queue[Observation] = queue.Queue(maxsize=_BACKLOG)

    def on_message(raw: RawInbound) -> None:
        seen = observer.observe(raw.topic, raw.payload, raw.retained)
        if seen is not None:
            backlog.put(seen)

    printed = 0
    deadline = time.monotonic() + args.timeout if args.timeout else None
    try:
        # QoS 0: an onlooker that cannot keep up misses messages rather than holding the broker back (a QoS 1
        # subscriber's full inbox pushes back through TCP, docs/bus-rate.md).
        bus.subscribe_raw(args.filter, on_message, qos=0)
        while not args.count or printed < args.count:
            wait = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            if wait <= 0:
                break
            try:
                seen = backlog.get(timeout=wait)
            except queue.Empty:
                continue
            console.out(json_line(seen) if args.json else readable_line(seen), highlight=False)
            printed += 1
    finally:
        bus.stop()
    if args.count and printed < args.count:
        err_console.print(f"only {printed} of {args.count} messages on {args.filter} within {args.timeout:g} s",
                          markup=False, soft_wrap=True)
        return 1
    return 0


def json_line(seen: Observation) -> str:
    """``seen`` as one line of JSON (``schema`` for the schema's name)."""
    return json.dumps(seen.model_dump(mode="json", by_alias=True), separators=(",", ":"), default=str)


def readable_line(seen: Observation) -> str:
    """``seen`` as one line for a person: time, topic, schema, sender, flags, then the fields and the tensor."""
    stamp = datetime.datetime.fromtimestamp(seen.time).strftime("%H:%M:%S.%f")[:-3]
    if seen.error is not None:
        return f"{stamp}  {seen.topic}  {seen.error}" + ("  retained" if seen.retained else "")
    parts = [stamp, seen.topic, f"{seen.schema_name} v{seen.version}", f"from {seen.sender}"]
    if seen.retained:
        parts.append("retained")
    if seen.expired:
        parts.append("EXPIRED")
    if seen.tensor is not None:
        t = seen.tensor
        shape = "x".join(str(d) for d in t.shape) or "scalar"
        parts.append(f"tensor {t.dtype}[{shape}] {t.nbytes} bytes in {t.chunks} chunk{'s' if t.chunks != 1 else ''}")
    parts.append(" ".join(f"{k}={_short(v)}" for k, v in seen.fields.items()))
    return "  ".join(p for p in parts if p)


def _short(value: Any) -> str:
    text = json.dumps(value, separators=(",", ":"), default=str)
    return text if len(text) <= _FIELD_CHARS else text[: _FIELD_CHARS - 3] + "..."
