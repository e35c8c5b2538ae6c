"""One rank of ``edgeswarm bench collectives --processes``, in a process of its own, as a real cluster has it (no
interpreter lock shared with the other ranks, its own network thread and inbox).

The parent (``bench.collectives``) starts ``python -m edgeswarm.bench.collective_rank`` once per rank and talks to it
in JSON lines: it writes a ``RankSetup``, the rank answers ``RankReady`` once its bus, its ports and its bare paho
peer are up and every other rank's status is known; then for each ``RankCell`` it writes, the rank runs that
collective once untimed and ``repeats`` times timed, and answers with a ``RankTimes``. The rank exits when its
standard input closes. Every rank draws the same seeded vectors, so each checks its own result.
"""

from __future__ import annotations

import select
import subprocess
import sys
import time
import uuid

import torch
from pydantic import BaseModel

from edgeswarm import topics
from edgeswarm.bench.collective_steps import (
    DTYPES,
    JOB,
    SERVICE,
    Op,
    Payloads,
    Transport,
    announce,
    check_result,
    expected_result,
    replay,
    run_collective,
    schedule,
    seeded_vector,
    started_bus,
)
from edgeswarm.bus import Inbound
from edgeswarm.bus.mqtt import RawPeer
from edgeswarm.errors import EdgeswarmError
from edgeswarm.messages.collectives import CollectiveTensor
from edgeswarm.runtime.collective_exchange import CollectivePort
from edgeswarm.runtime.collectives import even_bounds
from edgeswarm.runtime.exchange import TensorExchange
from edgeswarm.settings import Settings


class RankSetup(BaseModel):
    """Which rank this process is, among how many, on which broker."""

    broker_url: str
    rank: int
    peers: int


class RankReady(BaseModel):
    """The rank is up: its bus, ports and bare paho peer, every other rank's status known."""

    rank: int


class RankCell(BaseModel):
    """One cell: ``op`` on ``elements`` values of ``dtype``, through the bus or bare paho, ``repeats`` times timed."""

    index: int
    op: Op
    elements: int
    dtype: str = "float32"
    repeats: int
    transport: Transport


class RankTimes(BaseModel):
    """This rank's seconds for each timed repeat of cell ``index``, or why it failed."""

    index: int
    rank: int
    seconds: list[float]
    error: str | None = None


def main() -> int:
    """Serve one rank, as the module's docstring says; 0 when stdin closed, 1 when the rank could not start."""
    setup = RankSetup.model_validate_json(sys.stdin.readline())
    torch.set_num_threads(1)  # as in the one-process bench: the slices' arithmetic is tiny
    rank, n = setup.rank, setup.peers
    nodes = [f"peer{r}" for r in range(n)]
    settings = Settings(hub_url=setup.broker_url)
    bus = started_bus(settings, nodes[rank])
    exchange: TensorExchange[object] = TensorExchange(bus, SERVICE, wait_s=60.0, name=nodes[rank])
    ports = {dtype: CollectivePort(exchange, f"{JOB}-{dtype}", dtype=dtype) for dtype in DTYPES}
    by_job = {port.job_id: port for port in ports.values()}
    refused: list[str] = []

    def on_slice(msg: Inbound) -> None:
        port = by_job.get(getattr(msg.body, "job_id", ""))
        problem = None if port is None else port.accept(msg, nodes, rank)
        if port is None or problem is not None:
            refused.append(problem.detail if problem is not None else "a slice of an unknown job")

    raw = RawPeer(setup.broker_url, f"raw{rank}.{uuid.uuid4().hex[:8]}", f"raw/{rank}")
    try:
        bus.subscribe(topics.data(nodes[rank], SERVICE), on_slice, schemas=(CollectiveTensor,), plane="data")
        announce(bus)
        for node in nodes:
            bus.peers.wait_for(node, SERVICE, timeout_s=30.0)
        _answer(RankReady(rank=rank))
        payloads = Payloads()
        received = 0
        for line in sys.stdin:
            cell = RankCell.model_validate_json(line)
            seconds: list[float] = []
            error = None
            try:
                if cell.transport == "paho":
                    plan = schedule(cell.op, n, even_bounds(cell.elements, n), getattr(torch, cell.dtype).itemsize)
                    for _ in range(cell.repeats + 1):
                        start = time.perf_counter()
                        received = replay(raw, plan[rank], settings.chunk_bytes, received, payloads.get, rank)
                        seconds.append(time.perf_counter() - start)
                else:
                    seconds = _bus_cell(cell, ports[cell.dtype], exchange, nodes, rank, refused)
            except EdgeswarmError as exc:
                error = str(exc)
            _answer(RankTimes(index=cell.index, rank=rank, seconds=seconds[1:], error=error))
        return 0
    finally:
        exchange.close(timeout_s=1.0)
        bus.stop()
        raw.close()


def _bus_cell(cell: RankCell, port: CollectivePort, exchange: TensorExchange[object], nodes: list[str], rank: int,
              refused: list[str]) -> list[float]:
    """The cell's collective through the bus, once untimed then ``repeats`` times: each repeat's seconds."""
    n = len(nodes)
    bounds = even_bounds(cell.elements, n)
    vectors = [seeded_vector(cell.elements, cell.dtype, r) for r in range(n)]
    want = expected_result(cell.op, vectors, bounds)
    seconds = []
    for repeat in range(cell.repeats + 1):
        scope = cell.index * 100_000 + repeat + 1
        start = time.perf_counter()
        result = run_collective(cell.op, port, nodes, rank, scope, vectors[rank], bounds)
        seconds.append(time.perf_counter() - start)
        if refused:
            raise EdgeswarmError(f"rank {rank} refused a slice: {refused[0]}")
        check_result(cell.op, rank, bounds, result, want)
        exchange.forget(scope)
        port.forget(scope)
    return seconds


class RankProcesses:
    """``n`` rank processes on the broker at ``broker_url`` (the parent's side of the protocol above); stop with
    ``close``. Raises EdgeswarmError when a rank does not come up within ``timeout_s`` seconds."""

    def __init__(self, broker_url: str, n: int, timeout_s: float = 120.0) -> None:
        self.n = n
        self._procs: list[subprocess.Popen[str]] = []
        try:
            for rank in range(n):
                proc = subprocess.Popen([sys.executable, "-m", "edgeswarm.bench.collective_rank"], text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                self._procs.append(proc)
                self._send(proc, RankSetup(broker_url=broker_url, rank=rank, peers=n))
            for proc in self._procs:
                RankReady.model_validate_json(self._line(proc, timeout_s))
        except BaseException:
            self.close()
            raise

    def run(self, cell: RankCell, timeout_s: float = 300.0) -> list[float]:
        """``cell`` on every rank at once: each timed repeat's seconds, the slowest rank's (a collective lasts until
        its last rank has its result). Raises EdgeswarmError naming the first rank that failed."""
        for proc in self._procs:
            self._send(proc, cell)
        answers = [RankTimes.model_validate_json(self._line(proc, timeout_s)) for proc in self._procs]
        for answer in answers:
            if answer.error is not None or len(answer.seconds) != cell.repeats:
                raise EdgeswarmError(f"{cell.op} on {cell.transport}: rank {answer.rank} failed: {answer.error}")
        return [max(times) for times in zip(*(a.seconds for a in answers), strict=True)]

    def close(self) -> None:
        for proc in self._procs:
            if proc.stdin is not None and not proc.stdin.closed:
                proc.stdin.close()
        for proc in self._procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    @staticmethod
    def _send(proc: subprocess.Popen[str], message: BaseModel) -> None:
        assert proc.stdin is not None
        proc.stdin.write(message.model_dump_json() + "\n")
        proc.stdin.flush()

    @staticmethod
    def _line(proc: subprocess.Popen[str], timeout_s: float) -> str:
        """The rank's next answer; EdgeswarmError when it exited or stayed silent ``timeout_s`` seconds."""
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line:
            raise EdgeswarmError(f"a rank process ({proc.pid}) did not answer within {timeout_s:.0f} s"
                                 if proc.poll() is None else f"a rank process exited with {proc.returncode}")
        return line


def _answer(message: BaseModel) -> None:
    sys.stdout.write(message.model_dump_json() + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
