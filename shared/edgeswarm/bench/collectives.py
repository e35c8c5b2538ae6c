"""``edgeswarm bench collectives``: ring AllGather and ReduceScatter among N bus instances, against the link and
against bare paho, and the 1 KB message rate between two bus instances, all measured in one run.

One Mosquitto on a free loopback port, N peers in this process (one Bus each, with a TensorExchange and a
CollectivePort, as a worker holds them). Each collective runs on N threads at once (one per rank) through
``runtime.collectives`` over ``runtime.collective_exchange``; its time runs from the first rank's start to the
last rank's end, and the median of the repeats is reported. Two references, measured in the same run:

* the link: the bytes one rank sends in the collective ((N - 1) of the N slices of the vector) at the loopback's
  bulk rate, measured here through a TCP connection on 127.0.0.1 (each rank has its own link in a real ring;
  through the broker every byte crosses loopback twice, so 1x is out of reach by construction);
* bare paho (``bus.mqtt.RawPeer``): the same ring (N - 1 steps, each rank publishing its slice to its right
  neighbour, cut into frames at the bus's chunk size, and waiting for its left neighbour's before the next step),
  same payload sizes without edgeswarm's frame header, QoS 1, the same send window, acknowledged on paho's thread.

The rate part sends ``rate_messages`` 1 KB float32 tensors from one bus instance to another's data topic
(``Bus.send_tensor``, received by a subscribed handler) and the same count of 1 KB payloads between two bare paho
clients. Everything shares one process and, here, two cores with the broker: compare the ratios, not the figures.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Literal

import torch
from pydantic import BaseModel, Field

from edgeswarm import __version__, topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.bus.mqtt import RawPeer
from edgeswarm.errors import EdgeswarmError
from edgeswarm.local.broker import BrokerProcess, mosquitto_binary, start_broker
from edgeswarm.messages import BenchData, Status
from edgeswarm.messages.collectives import CollectiveTensor
from edgeswarm.runtime.collective_exchange import CollectivePort, exchange_ring
from edgeswarm.runtime.collectives import Bounds, even_bounds, ring_all_gather, ring_reduce_scatter
from edgeswarm.runtime.exchange import TensorExchange
from edgeswarm.settings import Settings
from edgeswarm.wire import Sender

KB = 1024
MB = 1024 * 1024
SERVICE = "bench-coll"
JOB = "bench"
MAX_PEERS = 6
MAX_SIZE = 64 * MB
DEFAULT_PEERS = (2, 3, 4, 5, 6)
DEFAULT_SIZES = (KB, 64 * KB, MB, 16 * MB)
Op = Literal["all_gather", "reduce_scatter"]
OPS: tuple[Op, ...] = ("all_gather", "reduce_scatter")


def default_repeats(size: int) -> int:
    """Collectives timed per cell for a vector of ``size`` bytes: many of the small ones, few of the large."""
    return 30 if size <= 64 * KB else 8 if size <= MB else 3


class CollectiveRow(BaseModel):
    """One collective among ``peers`` ranks on a float32 vector of ``size_bytes``: median seconds per collective
    through the bus, through bare paho, and what the bytes need on the link. ``messages`` is the frames all ranks
    publish in one collective."""

    op: Op
    peers: int
    size_bytes: int
    repeats: int
    messages: int
    bus_s: float
    paho_s: float
    link_s: float

    @property
    def over_paho(self) -> float:
        return self.bus_s / self.paho_s if self.paho_s else 0.0

    @property
    def over_link(self) -> float:
        return self.bus_s / self.link_s if self.link_s else 0.0

    @property
    def messages_per_s(self) -> float:
        return self.messages / self.bus_s if self.bus_s else 0.0


class RateFigures(BaseModel):
    """1 KB messages one way between two instances: per second through the bus and through bare paho."""

    messages: int
    payload_bytes: int
    bus_per_s: float
    paho_per_s: float

    @property
    def ratio(self) -> float:
        return self.bus_per_s / self.paho_per_s if self.paho_per_s else 0.0


class CollectivesReport(BaseModel):
    """Everything ``edgeswarm bench collectives`` measured in one run."""

    broker: str
    chunk_bytes: int
    loopback_mb_s: float = Field(description="bulk TCP rate on 127.0.0.1, 10^6 bytes per second")
    rate: RateFigures
    rows: list[CollectiveRow]


def run_collectives_bench(*, peers: tuple[int, ...] = DEFAULT_PEERS, sizes: tuple[int, ...] = DEFAULT_SIZES,
                          repeats: int | None = None, rate_messages: int = 20000,
                          progress: Callable[[str], None] = lambda _msg: None) -> CollectivesReport:
    """Measure as the module's docstring says; ``repeats`` None picks ``default_repeats`` per size. Starts and
    stops its own broker. Raises EdgeswarmError when a collective or a transfer fails."""
    for n in peers:
        if not 2 <= n <= MAX_PEERS:
            raise ValueError(f"peers must be 2 to {MAX_PEERS}, not {n}")
    for size in sizes:
        if not 4 <= size <= MAX_SIZE or size % 4:
            raise ValueError(f"a size is a whole number of float32 elements up to {MAX_SIZE} bytes, not {size}")
    broker = start_broker("mosquitto" if mosquitto_binary() else "auto")
    # One torch thread: the slices' arithmetic is tiny, and with several ranks in one process torch's OpenMP pool
    # spins on both cores between operations, starving the network threads and the broker (it doubled the time of
    # a 1 MB AllGather between two peers here).
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        settings = Settings(hub_url=broker.url)
        progress("loopback bulk rate")
        loopback = loopback_bytes_per_s()
        progress(f"1 KB rate, {rate_messages} messages, bus and bare paho")
        rate = _rate(broker, settings, rate_messages)
        rows = []
        for n in peers:
            with _BusRing(settings, n) as ring:
                raw = _RawRing(broker, n)
                try:
                    for size in sizes:
                        count = repeats or default_repeats(size)
                        for op in OPS:
                            progress(f"{op} among {n} peers, {_human(size)} x {count}")
                            rows.append(_measure(ring, raw, op, size, count, settings.chunk_bytes, loopback))
                finally:
                    raw.close()
        return CollectivesReport(broker=f"{broker.kind} {broker.url}", chunk_bytes=settings.chunk_bytes,
                                 loopback_mb_s=loopback / 1e6, rate=rate, rows=rows)
    finally:
        torch.set_num_threads(torch_threads)
        broker.stop()


def _measure(ring: _BusRing, raw: _RawRing, op: Op, size: int, repeats: int, chunk: int,
             loopback: float) -> CollectiveRow:
    n = ring.n
    bounds = even_bounds(size // 4, n)
    vectors = [torch.randn(size // 4, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    want = torch.stack(vectors).sum(0) if op == "reduce_scatter" else torch.cat(
        [vectors[r][a:b] for r, (a, b) in enumerate(bounds)])
    ring.run(op, vectors, bounds, want)  # untimed: the first of a size pays for page faults and buffer growth
    bus_s = statistics.median(ring.run(op, vectors, bounds, want) for _ in range(repeats))
    raw.run(op, bounds, chunk)
    paho_s = statistics.median(raw.run(op, bounds, chunk) for _ in range(repeats))
    frames = sum(_frames((b - a) * 4, chunk) for rank in range(n) for step in range(n - 1)
                 for a, b in [bounds[_sent_slice(op, rank, step, n)]])
    link_s = max(sum(bounds[_sent_slice(op, rank, s, n)][1] - bounds[_sent_slice(op, rank, s, n)][0]
                     for s in range(n - 1)) * 4 for rank in range(n)) / loopback
    return CollectiveRow(op=op, peers=n, size_bytes=size, repeats=repeats, messages=frames, bus_s=bus_s,
                         paho_s=paho_s, link_s=link_s)


def _sent_slice(op: Op, rank: int, step: int, n: int) -> int:
    """The slice rank ``rank`` sends at ring step ``step`` (runtime.collectives' schedule)."""
    return (rank - step - 1) % n if op == "reduce_scatter" else (rank - step) % n


def _frames(nbytes: int, chunk: int) -> int:
    return 0 if nbytes == 0 else -(-nbytes // chunk)


class _BusRing:
    """``n`` bus instances, each with a TensorExchange and a CollectivePort whose data-plane handler accepts the
    ring's slices, as a worker holds them."""

    def __init__(self, settings: Settings, n: int) -> None:
        self.n = n
        self.nodes = [f"peer{r}" for r in range(n)]
        self._scope = 0
        self.refused: list[str] = []  # what a port dropped: nothing, unless the bench itself is wrong
        self.buses: list[Bus] = []
        self.exchanges: list[TensorExchange[object]] = []
        self.ports: list[CollectivePort] = []
        try:
            for rank, node in enumerate(self.nodes):
                bus = _started_bus(settings, node)
                self.buses.append(bus)
                exchange: TensorExchange[object] = TensorExchange(bus, SERVICE, wait_s=60.0, name=node)
                port = CollectivePort(exchange, JOB)
                self.exchanges.append(exchange)
                self.ports.append(port)
                bus.subscribe(topics.data(node, SERVICE), self._handler(port, rank), schemas=(CollectiveTensor,),
                              plane="data")
                _announce(bus)
            for bus in self.buses:
                for node in self.nodes:
                    bus.peers.wait_for(node, SERVICE, timeout_s=10.0)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> _BusRing:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _handler(self, port: CollectivePort, rank: int) -> Callable[[Inbound], None]:
        def on_slice(msg: Inbound) -> None:
            refused = port.accept(msg, self.nodes, rank)
            if refused is not None:
                self.refused.append(f"peer {rank} refused a slice: {refused.detail}")
        return on_slice

    def run(self, op: Op, vectors: list[torch.Tensor], bounds: Bounds, want: torch.Tensor) -> float:
        """One collective on every rank at once; its seconds. Raises EdgeswarmError if a result is wrong."""
        self._scope += 1
        scope = self._scope

        def body(rank: int) -> torch.Tensor:
            send, recv = exchange_ring(self.ports[rank], self.nodes, rank, scope)
            if op == "all_gather":
                a, b = bounds[rank]
                return ring_all_gather(vectors[rank][a:b].clone(), rank, bounds, send, recv)
            return ring_reduce_scatter(vectors[rank], rank, bounds, send, recv)

        results, seconds = _on_every_rank(self.n, body)
        if self.refused:
            raise EdgeswarmError(self.refused[0])
        for rank, result in enumerate(results):
            a, b = bounds[rank]
            expected = want if op == "all_gather" else want[a:b]
            if not torch.allclose(result, expected, rtol=1e-4, atol=1e-4):
                raise EdgeswarmError(f"{op} among {self.n} peers: rank {rank} holds a wrong result")
        for exchange, port in zip(self.exchanges, self.ports, strict=True):
            exchange.forget(scope)
            port.forget(scope)
        return seconds

    def close(self) -> None:
        for exchange in self.exchanges:
            exchange.close(timeout_s=1.0)
        for bus in self.buses:
            bus.stop()


class _RawRing:
    """The same ring over bare paho: rank r publishes to ``raw/r+1`` and counts what arrives on ``raw/r``."""

    def __init__(self, broker: BrokerProcess, n: int) -> None:
        self.n = n
        self.peers: list[RawPeer] = []
        try:
            for rank in range(n):
                self.peers.append(RawPeer(broker.url, f"raw{rank}.{uuid.uuid4().hex[:8]}", f"raw/{rank}"))
        except BaseException:
            self.close()
            raise
        self._payloads: dict[int, bytes] = {}

    def run(self, op: Op, bounds: Bounds, chunk: int) -> float:
        """The collective's traffic on every rank at once (no arithmetic); its seconds."""
        n = self.n
        starts = [peer.received for peer in self.peers]

        def body(rank: int) -> None:
            right, waited = (rank + 1) % n, starts[rank]
            for step in range(n - 1):
                a, b = bounds[_sent_slice(op, rank, step, n)]
                for piece in self._pieces((b - a) * 4, chunk):
                    self.peers[rank].publish(f"raw/{right}", piece)
                left = _sent_slice(op, (rank - 1) % n, step, n)
                waited += _frames((bounds[left][1] - bounds[left][0]) * 4, chunk)
                if not self.peers[rank].wait_received(waited, 60.0):
                    raise EdgeswarmError(f"bare paho {op}: rank {rank} missed step {step}")

        return _on_every_rank(n, body)[1]

    def _pieces(self, nbytes: int, chunk: int) -> list[bytes]:
        pieces = []
        while nbytes > 0:
            size = min(nbytes, chunk)
            if size not in self._payloads:
                self._payloads[size] = bytes(size)
            pieces.append(self._payloads[size])
            nbytes -= size
        return pieces

    def close(self) -> None:
        for peer in self.peers:
            peer.close()


def _on_every_rank(n: int, body: Callable[[int], object]) -> tuple[list[object], float]:
    """``body(rank)`` on ``n`` threads released together; the results by rank and the seconds from the first
    start to the last end. Raises EdgeswarmError naming the first rank that failed."""
    results: list[object] = [None] * n
    errors: list[BaseException | None] = [None] * n
    spans = [(0.0, 0.0)] * n
    gate = threading.Barrier(n)

    def worker(rank: int) -> None:
        try:
            gate.wait(30.0)
            start = time.perf_counter()
            results[rank] = body(rank)
            spans[rank] = (start, time.perf_counter())
        except BaseException as exc:  # noqa: BLE001 - reported below, on the calling thread
            errors[rank] = exc

    threads = [threading.Thread(target=worker, args=(r,), name=f"bench-rank-{r}", daemon=True) for r in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300.0)
    for rank, error in enumerate(errors):
        if error is not None:
            raise EdgeswarmError(f"rank {rank} failed: {error}") from error
    if any(thread.is_alive() for thread in threads):
        raise EdgeswarmError("a rank did not finish within 300 s")
    return results, max(end for _, end in spans) - min(start for start, _ in spans)


def _rate(broker: BrokerProcess, settings: Settings, count: int) -> RateFigures:
    """``count`` 1 KB messages one way, bus to bus and bare paho to bare paho."""
    tensor = torch.zeros(KB // 4)
    sender, receiver = _started_bus(settings, "rate-a"), _started_bus(settings, "rate-b")
    try:
        got = [0]
        arrived = threading.Condition()

        def on_data(_msg: Inbound) -> None:
            with arrived:
                got[0] += 1
                arrived.notify_all()

        receiver.subscribe(topics.data("rate-b", SERVICE), on_data, schemas=(BenchData,), plane="data")
        _announce(receiver)
        body = BenchData(run_id="rate", seq=0)

        def bus_pass(messages: int) -> float:
            with arrived:
                target = got[0] + messages
            start = time.perf_counter()
            for _ in range(messages):
                sender.send_tensor("rate-b", SERVICE, body, tensor)
            with arrived:
                if not arrived.wait_for(lambda: got[0] >= target, 60.0 + messages / 1000):
                    raise EdgeswarmError(f"only {got[0]} of {target} bus messages arrived")
            return messages / (time.perf_counter() - start)

        bus_pass(min(count, 1000))  # untimed warm-up
        bus_rate = bus_pass(count)
    finally:
        sender.stop()
        receiver.stop()
    raw_sender = RawPeer(broker.url, f"rate-a.{uuid.uuid4().hex[:8]}", "raw/rate-a")
    raw_receiver = RawPeer(broker.url, f"rate-b.{uuid.uuid4().hex[:8]}", "raw/rate-b")
    try:
        payload = bytes(KB)

        def raw_pass(messages: int) -> float:
            target = raw_receiver.received + messages
            start = time.perf_counter()
            for _ in range(messages):
                raw_sender.publish("raw/rate-b", payload)
            if not raw_receiver.wait_received(target, 60.0 + messages / 1000):
                raise EdgeswarmError(f"only {raw_receiver.received} of {target} bare paho messages arrived")
            return messages / (time.perf_counter() - start)

        raw_pass(min(count, 1000))
        paho_rate = raw_pass(count)
    finally:
        raw_sender.close()
        raw_receiver.close()
    return RateFigures(messages=count, payload_bytes=KB, bus_per_s=bus_rate, paho_per_s=paho_rate)


def loopback_bytes_per_s(total: int = 256 * MB, block: int = MB) -> float:
    """Bulk rate of one TCP connection on 127.0.0.1 (bytes per second): ``total`` bytes in ``block``-byte writes
    to a reader thread, best of three."""
    best = 0.0
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        for _ in range(3):

            def drain() -> None:
                conn, _ = server.accept()
                with conn:
                    buf = bytearray(block)
                    left = total
                    while left > 0:
                        got = conn.recv_into(buf)
                        if not got:
                            break
                        left -= got
                    conn.sendall(b"\x01")

            reader = threading.Thread(target=drain, name="bench-loopback", daemon=True)
            reader.start()
            data = memoryview(bytes(block))
            with socket.create_connection(("127.0.0.1", port)) as conn:
                start = time.perf_counter()
                for _ in range(total // block):
                    conn.sendall(data)
                conn.recv(1)
                best = max(best, total / (time.perf_counter() - start))
            reader.join(10.0)
    return best


def _started_bus(settings: Settings, node: str) -> Bus:
    bus = Bus(settings, Sender(node=node, service=SERVICE, instance=uuid.uuid4().hex[:12]))
    bus.start(timeout_s=10.0)
    return bus


def _announce(bus: Bus) -> None:
    """Publish this instance's online status (retained), as a service does, so its peers know where its data goes."""
    s = bus.sender
    bus.publish(topics.status(s.node, s.service), Status(
        state="online", node=s.node, service=s.service, instance=s.instance, version=__version__,
        host=socket.gethostname()[:255], pid=0, device_class="bench", memory_budget_bytes=0, free_memory_bytes=0,
        data_url=bus.data.url, heartbeat_interval_s=bus.settings.heartbeat_interval_s, started_at=time.time()),
        retain=True)


def _human(size: int) -> str:
    return f"{size // MB} MB" if size >= MB and size % MB == 0 else f"{size // KB} KB" if size % KB == 0 else \
        f"{size} B"


def human_size(size: int) -> str:
    """``size`` bytes as the bench writes it: 16 MB, 64 KB, 12 B."""
    return _human(size)
