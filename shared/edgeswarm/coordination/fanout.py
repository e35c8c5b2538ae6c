"""Send every device of a job its request at once and collect the replies and the failures.

In the manner of Flower's ``fit_clients``, which returns ``(results, failures)``: the caller decides what a failure
means (a training round gives up, a serving deploy fails the plan). ``watch`` lets a caller end the wait early
(a device confirmed lost, a cancellation, a refusal it recognises) or shorten it (a grace period for the others).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from edgeswarm import topics
from edgeswarm.bus import Bus, Expectation
from edgeswarm.errors import BusError, NotAuthorizedError, RequestRejectedError, RequestTimeoutError
from edgeswarm.messages import RequestRejected
from edgeswarm.wire import Message

POLL_S = 0.005  # how often the wait looks at the replies, the connection and ``watch``

#: Called on every poll with the replies so far. None: go on waiting; a number: wait at most that many more
#: seconds (0: stop now). A shorter answer wins over a longer one given earlier.
Watch = Callable[[Mapping[str, Message]], "float | None"]


@dataclass
class FanOut:
    """What came back: ``replies`` by key, ``failures`` by key for every request without a reply (the request
    could not be sent, the broker or the receiver refused it, or no reply came before the wait ended), and whether
    this side's connection to the broker dropped while it waited (``interrupted``: requests and replies of that
    time may be lost, and the wait ended then)."""

    replies: dict[str, Message] = field(default_factory=dict)
    failures: dict[str, BusError] = field(default_factory=dict)
    interrupted: bool = False


def fan_out(bus: Bus, messages: Mapping[str, Message], service: str, *, timeout_s: float,
            targets: Mapping[str, str] | None = None, watch: Watch | None = None,
            stop_on_reconnect: bool = True) -> FanOut:
    """Send each of ``messages`` (key -> request) to ``service`` on its node at once and wait at most ``timeout_s``
    seconds for all the replies. A key is the node, unless ``targets`` maps it to one (several requests to one node
    need keys of their own). ``watch`` may end the wait early (see ``Watch``); so does a dropped connection to the
    broker unless ``stop_on_reconnect`` is False. Never raises for one device's problem: every request that got no
    usable reply is in ``failures``."""
    targets = targets or {}
    connection = bus.hub.connects
    result = FanOut()
    expectations: dict[str, Expectation] = {}
    for key, message in messages.items():
        node = targets.get(key, key)
        exp = bus.expect()
        try:
            bus.publish(topics.request(node, service), message, correlation_id=exp.correlation_id,
                        reply_to=bus.reply_topic, ttl_s=timeout_s)
        except BusError as exc:
            exp.wait(0)  # ends the expectation
            result.failures[key] = exc
            continue
        expectations[key] = exp
    deadline = time.monotonic() + timeout_s
    stopped = False  # by ``watch``
    waiting = dict(expectations)
    while waiting and time.monotonic() < deadline:
        for key in [k for k, exp in waiting.items() if exp.arrived]:
            _settle(result, key, waiting.pop(key), messages[key], targets.get(key, key), service)
        if stop_on_reconnect and bus.hub.connects != connection:
            result.interrupted = True
            break
        if watch is not None:
            more = watch(result.replies)
            if more is not None:
                deadline = min(deadline, time.monotonic() + more)
                if more <= 0:
                    stopped = True
                    break
        if waiting:
            time.sleep(POLL_S)
    for key, exp in waiting.items():
        if exp.arrived:
            _settle(result, key, exp, messages[key], targets.get(key, key), service)
        else:
            exp.wait(0)
            result.failures[key] = RequestTimeoutError(
                f"no reply from the {service} on {targets.get(key, key)} to {messages[key].SCHEMA}" +
                (" (the connection to the broker dropped meanwhile)" if result.interrupted else
                 " (stopped waiting)" if stopped else f" within {timeout_s:.0f} s"))
    return result


def _settle(result: FanOut, key: str, exp: Expectation, message: Message, node: str, service: str) -> None:
    """File the reply that arrived for ``key`` as a reply or, when the request was refused, as a failure."""
    reply = exp.wait(0)
    if exp.refusal is not None or reply is None:
        result.failures[key] = NotAuthorizedError(f"the broker refused {message.SCHEMA} to the {service} on {node} "
                                                  f"({exp.refusal})")
    elif isinstance(reply.body, RequestRejected):
        result.failures[key] = RequestRejectedError(f"the {service} on {node} refused {message.SCHEMA} "
                                                    f"({reply.body.reason}): {reply.body.detail}",
                                                    reason=reply.body.reason)
    else:
        result.replies[key] = reply.body
