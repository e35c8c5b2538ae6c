"""Ring collectives over a job's ``TensorExchange``: the binding, the sender check and the retry, written once.

``runtime.collectives`` runs a ring over two callables, ``send(to_rank, step, tensor)`` and ``recv(from_rank,
step)``. A ``CollectivePort`` (one per job and plan epoch, over the job's exchange) binds them to the data plane:

* ``ring(nodes, rank, scope, ...)`` gives the pair for one collective: ``send`` queues the slice as a
  ``CollectiveTensor`` for ``nodes[to_rank]`` on the exchange (one outbox per peer), ``recv`` waits on the exchange
  for the ``CollectiveKey`` (scope, collective, step, from_rank). ``scope`` is the exchange scope the collective
  belongs to (training's round): failing, aborting or forgetting the scope covers its collectives too.
* ``accept(msg, nodes, rank)`` is the data-plane handler's half: it refuses a tensor whose envelope's node is not
  the ring member whose rank it claims, or whose rank is not the one that may send it (a slice comes from the left
  neighbour only, a resend request from the right neighbour only; a frame marked ``direct`` from any other member),
  or whose tensor is not a 1-D tensor of the port's dtype (that fails the scope: the genuine peer sent something
  unusable); otherwise it ``put``s the tensor under its key, or answers the resend request. Every workload that
  runs collectives uses this one check.

Direct collectives (``direct_all_reduce``, ``direct_all_gather``) run over the same ``ring(...)`` pair: ``send``
marks a slice to any rank but the right neighbour ``direct``, and ``recv`` marks a resend request to any rank but
the left neighbour so, so neither side needs to be told which kind of collective it runs (a slice between
neighbours is an ordinary ring slice either way). The retry below works the same for them: the receiver asks the
rank it waits on.

QoS, deadline and retry, per collective (``ring(..., qos=, deadline_s=)``):

* QoS 1 (the default, what training uses): the broker redelivers, so a slice that does not come within
  ``deadline_s`` (default: the exchange's ``wait_s``) means the peer is gone or stuck: the scope is failed (every
  wait of it gives up at once) and ExchangeTimeout is raised.
* QoS 0 (cheaper: no PUBACK per frame; a frame may be lost): the sender keeps every slice it sent until the scope is
  forgotten. A receiver whose slice has not come within ``deadline_s`` asks its left neighbour for that step once,
  with a resend request at QoS 1; the neighbour sends the slice again at QoS 1 (or, if it has not sent it yet,
  sends it at QoS 1 when it does). If the slice still does not come within another ``deadline_s``, the scope is
  failed and ExchangeTimeout is raised. A late original and its resend may both arrive: they are the same bytes,
  and the later one replaces the earlier (or waits, unused, until the scope is forgotten). ``deadline_s`` should
  be well above a step's usual time: a lost slice holds the ring up by about ``deadline_s``, so the ranks after
  it may miss their deadline too and ask as well (harmless: they get their slice at QoS 1), and a second loss in
  the same collective can fail it.

The port never tells other peers that a scope failed: each of them times out on its own, within its deadline(s),
or the workload's coordinator aborts the scope (training's StageAbort). The slices kept for resending are bounded
by ``max_kept_scopes`` (the oldest scope's go first); ``forget(scope)`` drops them when the scope is over.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.collectives import CollectiveTensor
from edgeswarm.runtime.exchange import ExchangeTimeout, TensorExchange

if TYPE_CHECKING:
    import torch

    from edgeswarm.bus import Inbound
    from edgeswarm.runtime.collectives import Recv, Send

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

MAX_WANTED = 4096  # resend requests held for slices not sent yet (only ring members can add them)


@dataclass(frozen=True)
class CollectiveKey:
    """The slice of ring step ``step`` from rank ``sender`` of collective ``collective`` of exchange scope
    ``scope``. A dataclass, not a tuple, so it never equals another kind of key held in the same exchange."""

    scope: int
    collective: int
    step: int
    sender: int

    def __str__(self) -> str:
        return (f"collective tensor (scope {self.scope}, collective {self.collective}, step {self.step}, from rank "
                f"{self.sender})")


class Refusal(NamedTuple):
    """Why ``accept`` dropped a message: ``stale`` (another job or plan epoch), ``sender`` (not from the ring member
    that may send it; the genuine one may still come) or ``tensor`` (unusable; the scope was failed)."""

    reason: Literal["stale", "sender", "tensor"]
    detail: str


def ring_sender_problem(nodes: Sequence[str], rank: int, body: CollectiveTensor, sender_node: str) -> str | None:
    """Why ``body``, which came from ``sender_node``, is not from the member of the ring ``nodes`` (node of each
    rank) that may send it to rank ``rank``: its claimed rank must be in the ring and be ``sender_node``, and be
    ``rank``'s left neighbour for a slice or its right neighbour for a resend request, or, for a ``direct`` frame,
    any rank but ``rank``. None when it is."""
    n = len(nodes)
    what = (f"a collective {'resend request' if body.resend else 'tensor'} (scope {body.scope}, collective "
            f"{body.collective}, step {body.step}) from {sender_node} claiming rank {body.sender}")
    if not 0 <= rank < n:
        return f"{what}: this worker is not in that ring ({n} ranks)"
    if body.sender >= n or nodes[body.sender] != sender_node:
        member = nodes[body.sender] if body.sender < n else "nobody"
        return f"{what}: rank {body.sender} of the ring is {member}"
    if body.direct:
        if body.sender == rank:
            return f"{what}: rank {rank} does not send to itself"
        return None
    may = (rank + 1) % n if body.resend else (rank - 1) % n
    if n == 1 or body.sender != may:
        return f"{what}: only rank {may} sends that to rank {rank} of a ring of {n}"
    return None


_Kept = tuple[str, CollectiveTensor, "torch.Tensor"]  # peer node, message, slice


class CollectivePort:
    """The collectives of job ``job_id`` at plan ``epoch`` over its ``exchange`` (see the module's docstring);
    slices travel as wire dtype ``dtype`` ("float32", "bfloat16"). Thread-safe. ``asked`` counts the resend
    requests this port sent (slices that missed their deadline at QoS 0), ``resent`` the slices it sent again."""

    def __init__(self, exchange: TensorExchange[Any], job_id: str, *, epoch: int = 0, dtype: str = "float32",
                 max_kept_scopes: int = 16) -> None:
        self.exchange = exchange
        self.job_id = job_id
        self.epoch = epoch
        self.dtype = dtype
        self._max_kept_scopes = max_kept_scopes
        self._lock = threading.Lock()
        self._kept: dict[int, dict[tuple[int, int, int], _Kept]] = {}  # scope -> (collective, step, to) -> slice
        self._wanted: set[tuple[int, int, int, int]] = set()  # (scope, collective, step, to) asked before sent
        self.asked = 0
        self.resent = 0

    def ring(self, nodes: Sequence[str], rank: int, scope: int, *, collective: int = 0, qos: int = 1,
             deadline_s: float | None = None) -> tuple[Send, Recv]:
        """``send`` and ``recv`` for collective ``collective`` of ``scope`` among ``nodes`` (node of each rank;
        this worker is rank ``rank``), for ``ring_reduce_scatter``, ``ring_all_gather``, ``ring_all_reduce``,
        ``direct_all_reduce`` or ``direct_all_gather``.
        ``qos`` 0 or 1 and ``deadline_s`` (seconds to wait for one step's slice; default the exchange's
        ``wait_s``) as the module's docstring says. ``recv`` raises ExchangeTimeout (the scope failed),
        ExchangeFailed or ExchangeAborted."""
        import torch  # late: a worker imports torch when a job runs, not when it starts

        if qos not in (0, 1):
            raise ValueError(f"a collective runs at QoS 0 or 1, not {qos}")
        if not 0 <= rank < len(nodes):
            raise ValueError(f"rank {rank} is not in a ring of {len(nodes)}")
        members = tuple(nodes)
        exchange = self.exchange
        wait_s = exchange.wait_s if deadline_s is None else deadline_s

        n = len(members)
        right, left = (rank + 1) % n, (rank - 1) % n

        def message(step: int, *, resend: bool = False, direct: bool = False) -> CollectiveTensor:
            return CollectiveTensor(job_id=self.job_id, epoch=self.epoch, scope=scope, collective=collective,
                                    step=step, sender=rank, resend=resend, direct=direct)

        def send(to_rank: int, step: int, tensor: torch.Tensor) -> None:
            body, at = message(step, direct=to_rank != right), qos
            if qos == 0:
                at = self._keep(scope, (collective, step, to_rank), (members[to_rank], body, tensor))
            exchange.send(members[to_rank], scope, body, tensor, qos=at)

        def recv(from_rank: int, step: int) -> torch.Tensor:
            key = CollectiveKey(scope, collective, step, from_rank)
            try:
                return exchange.wait(key, timeout_s=wait_s)
            except ExchangeTimeout as exc:
                if qos == 1:
                    exchange.fail(scope, f"{exc}")
                    raise
            log.info("%s: no %s within %.1f s at QoS 0: asking %s again", exchange.name, key, wait_s,
                     members[from_rank])
            with self._lock:
                self.asked += 1
            exchange.send(members[from_rank], scope, message(step, resend=True, direct=from_rank != left),
                          torch.empty(0), qos=1)
            try:
                return exchange.wait(key, timeout_s=wait_s)
            except ExchangeTimeout as exc:
                exchange.fail(scope, f"{exc}, asked again once")
                raise ExchangeTimeout(f"{exc}, asked again once") from exc

        return send, recv

    def accept(self, msg: Inbound, nodes: Sequence[str], rank: int) -> Refusal | None:
        """Take ``msg`` (a CollectiveTensor from the data plane) for this worker, rank ``rank`` of the ring ``nodes``:
        hold its slice for ``recv``, or answer its resend request. Returns why it was dropped, or None. Never
        raises for anything the message holds."""
        body = msg.body
        assert isinstance(body, CollectiveTensor)
        if body.job_id != self.job_id or body.epoch != self.epoch:
            return Refusal("stale", f"a collective tensor of job {body.job_id} epoch {body.epoch} from {msg.sender}: "
                                    f"this port is job {self.job_id} epoch {self.epoch}")
        forged = ring_sender_problem(nodes, rank, body, msg.envelope.sender_node)
        if forged is not None:
            return Refusal("sender", forged)
        if body.resend:
            self._resend(body)
            return None
        view = msg.tensor
        if view is None or view.dtype != self.dtype or len(view.shape) != 1:
            got = "no tensor" if view is None else f"{view.dtype} {list(view.shape)}"
            problem = (f"a collective tensor (scope {body.scope}, collective {body.collective}, step {body.step}) from "
                       f"{msg.sender}: expected a 1-D {self.dtype} tensor, got {got}")
            self.exchange.fail(body.scope, f"dropped {problem}")
            return Refusal("tensor", problem)
        self.exchange.arrived(body.scope, msg.envelope.sender_node, view.arrival)
        self.exchange.put(CollectiveKey(body.scope, body.collective, body.step, body.sender), view.to_torch())
        return None

    def forget(self, scope: int) -> None:
        """Drop the slices kept for resending and the resend requests of ``scope`` (it has finished)."""
        with self._lock:
            self._kept.pop(scope, None)
            self._wanted = {w for w in self._wanted if w[0] != scope}

    def kept_bytes(self) -> int:
        """Bytes of the slices kept for resending."""
        with self._lock:
            return sum(t.numel() * t.element_size() for kept in self._kept.values() for _, _, t in kept.values())

    def _keep(self, scope: int, slot: tuple[int, int, int], kept: _Kept) -> int:
        """Keep a QoS 0 slice for a resend; the QoS to send it at (1 when its receiver asked for it already)."""
        with self._lock:
            held = self._kept.setdefault(scope, {})
            held[slot] = kept
            while len(self._kept) > self._max_kept_scopes:
                del self._kept[next(iter(self._kept))]  # dicts keep insertion order: the oldest scope
            asked = (scope, *slot)
            if asked in self._wanted:
                self._wanted.discard(asked)
                return 1
        return 0

    def _resend(self, body: CollectiveTensor) -> None:
        slot = (body.collective, body.step, body.sender)
        with self._lock:
            kept = self._kept.get(body.scope, {}).get(slot)
            if kept is None:
                if len(self._wanted) < MAX_WANTED:
                    self._wanted.add((body.scope, *slot))
                return
            self.resent += 1
        node, message, tensor = kept
        _limited.log(logging.INFO, "resend", "%s: sending step %d of scope %d, collective %d to %s again",
                     self.exchange.name, body.step, body.scope, body.collective, node)
        self.exchange.send(node, body.scope, message, tensor, qos=1)


def exchange_ring(port: CollectivePort, nodes: Sequence[str], rank: int, scope: int, *, collective: int = 0,
                  qos: int = 1, deadline_s: float | None = None) -> tuple[Send, Recv]:
    """``port.ring(...)``: the ``send`` and ``recv`` of one ring collective over ``port``'s exchange."""
    return port.ring(nodes, rank, scope, collective=collective, qos=qos, deadline_s=deadline_s)
