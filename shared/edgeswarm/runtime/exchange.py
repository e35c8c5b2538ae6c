"""The tensor exchange every worker kind uses: tensors from peers in, tensors to peers out.

A worker that computes with its peers (a pipeline stage, a tensor shard, a split-learning client) waits for
tensors that arrive on its data-plane topic and sends its own to peers. A ``TensorExchange`` holds both halves
for one job:

* In: the data-plane handler ``put``s each validated tensor under a typed key (a NamedTuple or frozen dataclass
  with a ``scope`` attribute: the round, the request); the computing thread ``wait``s for the key it needs. A
  wait gives up at once, rather than at its timeout, when its scope was failed (a peer's tensor of that scope was
  unusable, or one of ours could not be sent: the scope cannot complete), aborted (the coordinator gave it up),
  or the exchange was retired (a newer assignment replaces this one) or closed.
* Out: ``send`` queues a tensor on the outbox of its peer (one thread per peer, so links carry traffic at the
  same time and each keeps its order); a send that fails fails its scope.

Tensors cross between the compute device and host memory here only: a tensor taken by ``wait`` is moved to the
exchange's ``compute`` device, and ``send`` copies one to host memory (without blocking the computing thread on
CUDA: the peer's outbox thread waits for the copy before it reads the bytes).

``tensor_problem`` is the shape and dtype check a data-plane handler applies before it ``put``s a tensor, so a
bad tensor is refused with a reason before anything is allocated from it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from edgeswarm.devices.compute import to_compute, to_host
from edgeswarm.errors import EdgeswarmError
from edgeswarm.runtime.outbox import Outbox
from edgeswarm.values.limits import MAX_LINK_SAMPLES
from edgeswarm.values.profiles import LinkSample

if TYPE_CHECKING:
    import torch

    from edgeswarm.bus import Bus
    from edgeswarm.wire import Message
    from edgeswarm.wire.tensor import Arrival

log = logging.getLogger(__name__)


class ExchangeTimeout(EdgeswarmError):
    """A peer's tensor did not arrive in time."""


class ExchangeFailed(EdgeswarmError):
    """The scope was failed: a tensor of it could not be used, or one could not be sent."""


class ExchangeAborted(EdgeswarmError):
    """The scope was aborted, or the exchange was retired or closed."""


class ScopedKey(Protocol):
    """What a key must offer: it is hashable and names the scope (round, request) it belongs to."""

    @property
    def scope(self) -> Hashable: ...

    def __hash__(self) -> int: ...


K = TypeVar("K", bound=ScopedKey)


class TensorExchange(Generic[K]):
    """One job's tensors between this worker and its peers; thread-safe.

    ``bus`` sends (its ``send_tensor``) to ``service`` on each peer node; ``wait_s`` is the longest wait for one
    tensor, in seconds; ``name`` says whose exchange it is in logs; ``scope_name`` names a scope in error messages
    ("round" gives "round 3 aborted: ..."). A key's ``str`` should say what tensor it is ("activation tensor
    (round 3, ...)"): the timeout names it. ``compute`` is the device ``wait`` hands tensors over on (None: where
    they arrived, in host memory).
    """

    def __init__(self, bus: Bus, service: str, *, wait_s: float = 120.0, name: str = "",
                 scope_name: str = "scope", compute: torch.device | None = None) -> None:
        self.wait_s = wait_s
        self.compute = compute
        self.name = name
        self.scope_name = scope_name
        self.blocked_s = 0.0  # seconds waits have blocked, summed; the owner resets it (per round, say)
        # (scope, peer node) -> bytes, chunks, seconds (``arrived``)
        self._arrivals: dict[tuple[Hashable, str], tuple[int, int, float]] = {}
        self._bus = bus
        self._service = service
        self._changed = threading.Condition()
        self._inbox: dict[K, torch.Tensor] = {}
        self._failed: dict[Hashable, str] = {}  # scope -> why it cannot complete
        self._aborted: dict[Hashable, str] = {}  # scope -> why it was given up
        self._retired: str | None = None  # why every scope was given up
        self._closed = False  # sends are refused
        self._outboxes: dict[str, Outbox] = {}  # peer node -> its sender thread
        self._outbox_lock = threading.Lock()

    # --- in -----------------------------------------------------------------------------------------

    def put(self, key: K, value: torch.Tensor) -> None:
        """Hold ``value``, a tensor that arrived, for the ``wait`` on ``key`` (a later one of the same key
        replaces it). Dropped when the exchange was retired or closed: nobody will wait for it."""
        with self._changed:
            if self._retired is not None:
                log.debug("%s: dropped %s: %s", self.name, key, self._retired)
                return
            self._inbox[key] = value
            self._changed.notify_all()

    def arrived(self, scope: Hashable, sender: str, arrival: Arrival | None) -> None:
        """Count how a tensor of ``scope`` (a round, say) and of several chunks from peer node ``sender`` arrived
        (``WireTensor.arrival``; None for one of one chunk, which says nothing of the link), for ``take_arrivals``.
        Counted by scope because a peer may send a round's first tensor before this device has begun the round."""
        if arrival is None or arrival.chunks < 1:
            return
        key = (scope, sender)
        with self._changed:
            if key not in self._arrivals and len(self._arrivals) >= MAX_LINK_SAMPLES:
                return
            nbytes, chunks, seconds = self._arrivals.get(key, (0, 0, 0.0))
            self._arrivals[key] = (nbytes + arrival.nbytes, chunks + arrival.chunks, seconds + arrival.seconds)

    def take_arrivals(self, scope: Hashable) -> list[LinkSample]:
        """What arrived from each peer for ``scope`` (``arrived``). Forgets every scope's counts: those of any
        other scope are a replayed or abandoned one's."""
        with self._changed:
            taken, self._arrivals = self._arrivals, {}
        mine = sorted((peer, totals) for (of, peer), totals in taken.items() if of == scope)
        return [LinkSample(src=peer, bytes=b, chunks=c, seconds=s) for peer, (b, c, s) in mine]

    def wait(self, key: K, *, rows: int | None = None, timeout_s: float | None = None) -> torch.Tensor:
        """Take the tensor held for ``key``, on the exchange's compute device, waiting at most ``timeout_s`` seconds
        (default ``wait_s``) for it.

        Raises ExchangeFailed when its scope was failed, or when ``rows`` is given and the tensor has another
        number of rows (first dimension); ExchangeAborted when its scope was aborted or the exchange retired or
        closed; ExchangeTimeout when it did not arrive in time. The time blocked is added to ``blocked_s``.
        """
        limit = self.wait_s if timeout_s is None else timeout_s
        started = time.monotonic()
        deadline = started + limit
        scope = key.scope
        with self._changed:
            # A failed or aborted scope fails every wait, even one whose tensor is already here: a bad tensor that
            # failed the round may come before the good one of the same key, and the good one must not hide it.
            while True:
                if scope in self._failed:
                    raise ExchangeFailed(self._failed[scope])
                if scope in self._aborted:
                    raise ExchangeAborted(f"{self._scope_text(scope)} aborted: {self._aborted[scope]}")
                if self._retired is not None:
                    raise ExchangeAborted(f"{self._scope_text(scope)} given up: {self._retired}")
                if key in self._inbox:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExchangeTimeout(f"no {key} within {limit:.0f} s")
                # Bounded, so a wake-up that was missed costs at most a second.
                self._changed.wait(min(left, 1.0))
            value = self._inbox.pop(key)
            self.blocked_s += time.monotonic() - started
        if rows is not None and value.shape[0] != rows:
            raise ExchangeFailed(f"a {key} of {value.shape[0]} rows where {rows} are expected")
        # Moved on the computing thread (the caller's), never on the bus's handler thread that put it.
        return to_compute(value, self.compute)

    def fail(self, scope: Hashable, reason: str) -> None:
        """Make every wait of ``scope`` raise ExchangeFailed with ``reason`` (the first reason given is kept)."""
        with self._changed:
            self._failed.setdefault(scope, reason)
            self._changed.notify_all()

    def abort(self, scope: Hashable, reason: str) -> None:
        """Make every wait of ``scope`` raise ExchangeAborted naming ``reason``."""
        with self._changed:
            self._aborted.setdefault(scope, reason)
            self._changed.notify_all()

    def retire(self, reason: str) -> None:
        """Make the waits of every scope, now and later, raise ExchangeAborted naming ``reason``; tensors that
        arrive from now on are dropped. For an exchange whose assignment a newer one replaces."""
        with self._changed:
            if self._retired is None:
                self._retired = reason
            self._inbox.clear()
            self._changed.notify_all()

    @property
    def retired(self) -> bool:
        """Whether ``retire`` or ``close`` was called."""
        return self._retired is not None

    def forget(self, scope: Hashable) -> None:
        """Drop the tensors held for ``scope`` and what is known of its failure or abort (it has finished)."""
        with self._changed:
            for key in [k for k in self._inbox if k.scope == scope]:
                del self._inbox[key]
            self._failed.pop(scope, None)
            self._aborted.pop(scope, None)

    def pending(self) -> int:
        """How many tensors are held, waiting to be taken."""
        with self._changed:
            return len(self._inbox)

    def pending_bytes(self) -> int:
        """How many bytes the held tensors take."""
        with self._changed:
            return sum(t.numel() * t.element_size() for t in self._inbox.values())

    # --- out ----------------------------------------------------------------------------------------

    def send(self, peer: str, scope: Hashable, message: Message, tensor: torch.Tensor, *, qos: int = 1,
             span: AbstractContextManager[object] | None = None) -> None:
        """Queue ``tensor`` with ``message`` for ``peer`` (a node) on that peer's outbox; returns at once. ``qos``
        is the MQTT QoS of its frames (0: it may be lost, and the scope needs a deadline and a retry of its own).

        The tensor is detached, moved to host memory and made contiguous here (an accelerator's tensor is copied
        once, at the wire, into pinned memory without blocking this thread; the outbox waits for the copy). Sends
        to one peer keep their order; one that fails fails ``scope``. Sending on a closed exchange is refused with
        ExchangeAborted. ``span`` (a ``tracing.spans`` span, say) times the send on the outbox's thread: the wait for
        the host copy and the transfer.
        """
        wire, ready = to_host(tensor)
        with self._outbox_lock:
            if self._closed:
                raise ExchangeAborted(f"{self.name}: the exchange is closed")
            outbox = self._outboxes.get(peer)
            if outbox is None:
                outbox = self._outboxes[peer] = Outbox(peer, self.fail)
        # QoS 1 is the bus's default and is not named, so a bus that knows no QoS (a test's) still sends.
        options = {} if qos == 1 else {"qos": qos}
        outbox.put(scope, partial(_send_when_ready, span or nullcontext(), ready,
                                  partial(self._bus.send_tensor, **options), peer, self._service, message, wire))

    def close(self, timeout_s: float = 5.0) -> None:
        """Give every waiter up, send what is queued (each outbox waits at most ``timeout_s`` seconds), and end
        the outbox threads."""
        with self._changed:
            if self._retired is None:
                self._retired = "the exchange is closed"
            self._inbox.clear()
            self._changed.notify_all()
        with self._outbox_lock:
            self._closed = True
            outboxes, self._outboxes = list(self._outboxes.values()), {}
        for outbox in outboxes:
            outbox.close(timeout_s)

    def _scope_text(self, scope: Hashable) -> str:
        return f"{self.scope_name} {scope}"


def _send_when_ready(span: AbstractContextManager[object], ready: Callable[[], None], send: Callable[..., object],
                     *args: object) -> object:
    with span:
        ready()  # the host copy's bytes are all there before the bus reads them
        return send(*args)


class TensorView(Protocol):
    """What ``tensor_problem`` reads of an arrived tensor (``edgeswarm.wire.WireTensor``)."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def tensor_problem(view: TensorView | None, *, dtype: str, sample_shape: tuple[int, ...] | None,
                   what: str) -> str | None:
    """Why an arrived tensor (``msg.tensor``; None when the message carried none) cannot be used: not of
    ``dtype`` (a wire dtype name, "float32"), or not rows of ``sample_shape`` (one sample's shape; None accepts any
    shape). ``what`` names the tensor in the answer. None when it is fine."""
    if view is None or view.dtype != dtype:
        return f"{what}: expected {dtype}, got {None if view is None else view.dtype}"
    shape = view.shape
    if sample_shape is not None and (len(shape) != len(sample_shape) + 1 or shape[1:] != sample_shape):
        return f"{what}: shape {list(shape)}, but this stage expects [rows, {', '.join(map(str, sample_shape))}]"
    return None

