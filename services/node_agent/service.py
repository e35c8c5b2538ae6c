"""The node agent: one per node. It advertises the node's device class, memory (with the bytes its memory ledger
holds for the jobs of every program on the node: ``runtime.ledger``, read from the ledger's file and re-announced
when it changes) and data-plane broker, and serves the data-plane sink and echo that link measurements and
``edgeswarm bench transport`` use. It samples the node's accelerator (``devices.accelerator``: use, temperature,
power, where the device reports them) into its metrics' gauges, for the dashboard and Prometheus.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from edgeswarm import topics
from edgeswarm.bus import Inbound
from edgeswarm.devices.accelerator import AcceleratorReading, AcceleratorSampler
from edgeswarm.errors import InvalidMessageError, UnknownRouteError
from edgeswarm.messages import BenchAck, BenchData, BenchEcho, BenchEchoReply, BenchStart
from edgeswarm.observability import catalogue
from edgeswarm.runtime.ledger import ledger_path, read_reserved
from edgeswarm.runtime.service import Service

MAX_OPEN_RUNS = 16


@dataclass
class _SinkRun:
    expected: int
    reply_to: str | None
    done_correlation_id: str
    received: int = 0
    bytes: int = 0
    first_at: float | None = None
    last_at: float | None = None


class NodeAgentService(Service):
    name = "node-agent"
    accelerator: AcceleratorReading = AcceleratorReading()  # the latest sample (every field None until one)

    def reserved_memory_bytes(self) -> int:
        return read_reserved(ledger_path(self.settings.health_dir, self.node, self.settings.hub_url))[0]

    def setup(self) -> None:
        self.watch_reserved_memory()
        # The node's discrete GPU, unless its settings keep it computing on the CPU (or Apple's GPU).
        self._accelerator = AcceleratorSampler(nvidia=self.settings.compute in ("auto", "cuda"))
        self.every(self.settings.metrics_interval_s, self._sample_accelerator, "accelerator")
        self._runs: OrderedDict[str, _SinkRun] = OrderedDict()
        self._runs_lock = threading.Lock()
        request = topics.request(self.node, self.name)
        self.bus.subscribe(request, self._on_bench_start, schemas=(BenchStart,))
        self.bus.subscribe(request, self._on_echo, schemas=(BenchEcho,))
        self.bus.subscribe(topics.data(self.node, self.name), self._on_bench_data, schemas=(BenchData,), plane="data")

    def _sample_accelerator(self) -> None:
        reading = self._accelerator.sample()
        self.accelerator = reading
        for name, value in ((catalogue.ACCELERATOR_UTILIZATION, reading.utilization),
                            (catalogue.ACCELERATOR_TEMPERATURE, reading.temperature_c),
                            (catalogue.ACCELERATOR_POWER, reading.power_w)):
            if value is None:
                self.metrics.forget_gauge(name)
            else:
                self.metrics.gauge(name, value)

    def _on_bench_start(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, BenchStart)
        env = msg.envelope
        # The final ack is published to reply_to later, outside Bus.reply's check: keep it only if it is a reply
        # address of the requester's own node. Any other topic is not the requester's to receive (and one the
        # broker refuses would cost this agent its connection).
        reply_to = env.reply_to if env.reply_to and topics.reply_owner(env.reply_to) == env.sender_node else None
        with self._runs_lock:
            self._runs[body.run_id] = _SinkRun(body.count, reply_to, body.done_correlation_id)
            while len(self._runs) > MAX_OPEN_RUNS:
                self._runs.popitem(last=False)
        self.bus.reply(msg, BenchAck(run_id=body.run_id, received=0, bytes=0))

    def _on_bench_data(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, BenchData)  # guaranteed by the subscription's schema filter
        if msg.tensor is None:
            raise InvalidMessageError(f"bench data {body.run_id}/{body.seq} from {msg.sender} carries no tensor")
        now = time.time()
        with self._runs_lock:
            run = self._runs.get(body.run_id)
            if run is None:
                raise UnknownRouteError(f"bench run {body.run_id!r} is not open on node {self.node}")
            run.received += 1
            run.bytes += msg.tensor.nbytes
            run.first_at = run.first_at or now
            run.last_at = now
            done = run.received >= run.expected
            if done:
                del self._runs[body.run_id]
        if done and run.reply_to:
            self.bus.publish(run.reply_to, BenchAck(run_id=body.run_id, received=run.received, bytes=run.bytes,
                                                    first_at=run.first_at, last_at=run.last_at),
                             correlation_id=run.done_correlation_id)

    def _on_echo(self, msg: Inbound) -> None:
        assert isinstance(msg.body, BenchEcho)
        self.bus.reply(msg, BenchEchoReply(payload=msg.body.payload))
