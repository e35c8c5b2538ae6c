"""What both forms of ``edgeswarm bench collectives`` run (all ranks in one process, or a process per rank): the
collectives as the runtime runs them over a CollectivePort, the traffic they send (``schedule``), which bare paho
replays, and the checks of their results."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable
from typing import Literal

import torch

from edgeswarm import __version__, topics
from edgeswarm.bus import Bus
from edgeswarm.bus.mqtt import RawPeer
from edgeswarm.errors import EdgeswarmError
from edgeswarm.messages import Status
from edgeswarm.runtime.collective_exchange import CollectivePort, exchange_ring
from edgeswarm.runtime.collectives import (
    Bounds,
    direct_all_gather,
    direct_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from edgeswarm.settings import Settings
from edgeswarm.wire import Sender
from edgeswarm.wire.tensor import expected_chunks

SERVICE = "bench-coll"
JOB = "bench"
Op = Literal["all_gather", "reduce_scatter", "all_reduce", "direct_all_gather", "direct_all_reduce"]
OPS: tuple[Op, ...] = ("all_gather", "reduce_scatter", "all_reduce", "direct_all_gather", "direct_all_reduce")
DTYPES = ("float32", "bfloat16")  # the dtypes a rank holds a CollectivePort for
Transport = Literal["bus", "paho"]


# One step of one rank in a collective: the bytes it sends to each peer, and the bytes it receives from each peer,
# before its next step.
Step = tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]


def schedule(op: Op, n: int, bounds: Bounds, itemsize: int = 4) -> list[list[Step]]:
    """Each rank's steps in ``op`` among ``n`` ranks over ``bounds`` (elements of ``itemsize`` bytes), as
    ``runtime.collectives`` runs them: per step, (peer, bytes) sent and (peer, bytes) received. Empty slices are
    neither sent nor received. The bare paho baseline replays it; the link figure sums it."""
    def size(j: int) -> int:
        a, b = bounds[j]
        return (b - a) * itemsize

    def ring(rank: int, first: Callable[[int, int], int]) -> list[Step]:
        # first(r, s): the slice rank r sends to its right at ring step s; so it receives first(left, s).
        right, left = (rank + 1) % n, (rank - 1) % n
        steps: list[Step] = []
        for s in range(n - 1):
            out, into = size(first(rank, s)), size(first(left, s))
            steps.append((((right, out),) if out else (), ((left, into),) if into else ()))
        return steps

    def gather(r: int, s: int) -> int:
        return (r - s) % n

    def scatter(r: int, s: int) -> int:
        return (r - s - 1) % n

    total = bounds[-1][1] * itemsize
    plans: list[list[Step]] = []
    for rank in range(n):
        others = [(rank + k) % n for k in range(1, n)]
        if op == "all_gather":
            plans.append(ring(rank, gather))
        elif op == "reduce_scatter":
            plans.append(ring(rank, scatter))
        elif op == "all_reduce":
            plans.append(ring(rank, scatter) + ring(rank, gather))
        elif op == "direct_all_gather":
            plans.append([(tuple((p, size(rank)) for p in others if size(rank)),
                           tuple((p, size(p)) for p in others if size(p)))])
        else:
            plans.append([(tuple((p, total) for p in others if total), tuple((p, total) for p in others if total))])
    return plans


def expected_result(op: Op, vectors: list[torch.Tensor], bounds: Bounds) -> torch.Tensor:
    """What every rank ends with: the whole sum (AllReduce), the sum (ReduceScatter: each rank checks its slice of
    it), or the slices put together (AllGather)."""
    if op in ("all_gather", "direct_all_gather"):
        return torch.cat([vectors[r][a:b] for r, (a, b) in enumerate(bounds)])
    return torch.stack([v.float() for v in vectors]).sum(0).to(vectors[0].dtype)


def seeded_vector(elements: int, dtype: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input: ``elements`` standard normal values drawn from seed ``rank``, as ``dtype``. Every rank of
    a process-per-rank run draws every rank's, so each can check its own result."""
    return torch.randn(elements, generator=torch.Generator().manual_seed(rank)).to(getattr(torch, dtype))


def run_collective(op: Op, port: CollectivePort, nodes: list[str], rank: int, scope: int, vector: torch.Tensor,
                   bounds: Bounds) -> torch.Tensor:
    """Rank ``rank``'s part of one ``op`` over ``port``: ``vector`` is its whole input (an AllGather sends its slice
    ``bounds[rank]`` of it); returns what the runtime's collective returns."""
    send, recv = exchange_ring(port, nodes, rank, scope)
    a, b = bounds[rank]
    if op == "all_gather":
        return ring_all_gather(vector[a:b].clone(), rank, bounds, send, recv)
    if op == "direct_all_gather":
        return direct_all_gather(vector[a:b].clone(), rank, bounds, send, recv)
    if op == "reduce_scatter":
        return ring_reduce_scatter(vector, rank, bounds, send, recv)
    if op == "all_reduce":
        return ring_all_reduce(vector, rank, bounds, send, recv)
    return direct_all_reduce(vector, rank, len(nodes), send, recv)


def check_result(op: Op, rank: int, bounds: Bounds, result: torch.Tensor, want: torch.Tensor) -> None:
    """Raise EdgeswarmError unless rank ``rank``'s ``result`` is ``want`` (its slice of it, for a ReduceScatter),
    to the precision of the slowest dtype summed in a different order."""
    a, b = bounds[rank]
    expected = want[a:b] if op == "reduce_scatter" else want
    if not torch.allclose(result.float(), expected.float(), rtol=1e-2, atol=1e-2):
        raise EdgeswarmError(f"{op} among {len(bounds)} peers: rank {rank} holds a wrong result")


def replay(peer: RawPeer, steps: list[Step], chunk: int, received: int, pieces: Callable[[int, int], list[bytes]],
           rank: int) -> int:
    """Rank ``rank``'s ``steps`` (``schedule``) over bare paho: publish each step's bytes to ``raw/{peer}`` in
    chunk-sized payloads, then wait until ``received`` plus that step's frames have arrived on this peer's topic.
    Returns the count of frames received so far. Raises EdgeswarmError when a step's frames do not arrive."""
    for index, (sends, receives) in enumerate(steps):
        for to, nbytes in sends:
            for piece in pieces(nbytes, chunk):
                peer.publish(f"raw/{to}", piece)
        received += sum(expected_chunks(nbytes, chunk) for _, nbytes in receives)
        if not peer.wait_received(received, 60.0):
            raise EdgeswarmError(f"bare paho: rank {rank} missed step {index}")
    return received


class Payloads:
    """Zero-filled payloads for the bare paho baseline, one per size, reused."""

    def __init__(self) -> None:
        self._by_size: dict[int, bytes] = {}

    def get(self, nbytes: int, chunk: int) -> list[bytes]:
        """``nbytes`` cut into payloads of at most ``chunk`` bytes."""
        pieces = []
        while nbytes > 0:
            size = min(nbytes, chunk)
            if size not in self._by_size:
                self._by_size[size] = bytes(size)
            pieces.append(self._by_size[size])
            nbytes -= size
        return pieces


def started_bus(settings: Settings, node: str) -> Bus:
    bus = Bus(settings, Sender(node=node, service=SERVICE, instance=uuid.uuid4().hex[:12]))
    bus.start(timeout_s=10.0)
    return bus


def announce(bus: Bus) -> None:
    """Publish this instance's online status (retained), as a service does, so its peers know where its data goes."""
    s = bus.sender
    bus.publish(topics.status(s.node, s.service), Status(
        state="online", node=s.node, service=s.service, instance=s.instance, version=__version__,
        host=socket.gethostname()[:255], pid=0, device_class="bench", memory_budget_bytes=0, free_memory_bytes=0,
        data_url=bus.data.url, heartbeat_interval_s=bus.settings.heartbeat_interval_s, started_at=time.time()),
        retain=True)
