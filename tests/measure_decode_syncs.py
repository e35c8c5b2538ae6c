"""Time per decode step of galaxy, ring syncs (before: ``direct_syncs`` patched off) against direct syncs (after),
on the loopback transport with an emulated link (1 Gbps, 1.5 ms in flight per message), over Mosquitto (with and
without 1.5 ms added in flight per message), and one decode row's AllReduce alone over Mosquitto (with the
process's CPU time). Each pair is run twice, interleaved. Not collected by the suite (no ``test_`` prefix) and no
assertion on time: run by hand, ``.venv/bin/python -m pytest -q -s tests/measure_decode_syncs.py``, and read the
printed lines."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import edgeswarm.hmp.layer as layer
from edgeswarm import topics
from edgeswarm.hmp.layer import HmpRank
from edgeswarm.hmp.loopback import Loopback
from edgeswarm.messages.collectives import CollectiveTensor
from edgeswarm.models.text import reference as ref
from edgeswarm.runtime.collective_exchange import CollectivePort
from edgeswarm.runtime.exchange import TensorExchange
from edgeswarm.values.text_model import PRESETS
from helpers import announce
from hmp_driver import in_threads, shares_for

CFG = PRESETS["gpt2-tiny"].model_copy(update={"layers": 8, "hidden": 256, "heads": 4, "ffn": 1024})
STEPS = 20
REAL = layer.direct_syncs


def _time_steps(n: int, rings: Callable[[int, int], Any], forget: Callable[[int, int], None] | None) -> dict:
    w = ref.init_weights(CFG, 5)
    shares = shares_for(CFG, "galaxy", n, "uneven")
    ranks = [HmpRank(CFG, shares, r, w, spans=False) for r in range(n)]
    barrier = threading.Barrier(n, timeout=60)
    times: list[float] = []
    produced: list[int] = []
    prompt = list(range(1, 9))

    def body(r: int) -> None:
        cache = ranks[r].new_cache()
        ids = prompt
        for step in range(STEPS + 1):
            barrier.wait()
            t0 = time.perf_counter()
            out = ranks[r].forward(ids, rings(r, step + 1), cache=cache)
            logits = ranks[r].next_logits(out)
            if logits is not None:
                produced.append(int(logits.argmax()))
            barrier.wait()
            if r == 0 and step > 0:
                times.append(time.perf_counter() - t0)
            if forget is not None:
                forget(r, step + 1)
            if step == 1:
                ranks[r].recorder.reset()  # the split of the decode steps only
            ids = [produced[-1]]
            barrier.wait()

    try:
        in_threads(n, body)
    finally:
        for rank in ranks:
            rank.close()
    t = ranks[0].recorder.times()
    comp = sum(x.compute_s for x in t)
    comm = sum(x.sync_s + x.wait_s for x in t)
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
            "comm_share": comm / (comp + comm), "tokens": produced}


@pytest.mark.parametrize("n", [3, 4])
def test_loopback(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    out = {}
    for label, rule in (("ring", lambda rows, parts: False), ("direct", REAL), ("ring2", lambda rows, parts: False),
                        ("direct2", REAL)):
        monkeypatch.setattr(layer, "direct_syncs", rule)
        loop = Loopback(n, bandwidth_bps=1e9, latency_s=1.5e-3)
        try:
            out[label] = _time_steps(n, loop.ring, None)
        finally:
            loop.close()
    assert out["ring"]["tokens"] == out["direct"]["tokens"]
    print(f"\nLOOPBACK D={n} 1.5ms 1Gbps {CFG.layers} layers h={CFG.hidden}: "
          + "; ".join(f"{k} median {v['median_ms']:.1f} ms min {v['min_ms']:.1f} ms comm {v['comm_share']:.0%}"
                      for k, v in out.items()))


def _ports(make_bus: Callable[..., Any], n: int,
           prefix: str) -> tuple[list[str], list[TensorExchange[Any]], list[CollectivePort], list[Any]]:
    """``n`` buses on the test broker with an exchange and a collective port each (float32): the nodes, the
    exchanges, the ports and the list of what the ports refused."""
    svc = "measure"
    buses = [make_bus(f"{prefix}{r}", svc) for r in range(n)]
    nodes = [bus.sender.node for bus in buses]
    exchanges: list[TensorExchange[Any]] = [TensorExchange(bus, svc, wait_s=10.0, name=f"{prefix}{r}",
                                                           scope_name="pass") for r, bus in enumerate(buses)]
    ports = [CollectivePort(x, "job", dtype=CFG.dtype) for x in exchanges]
    refused: list[Any] = []
    for rank, (bus, port) in enumerate(zip(buses, ports, strict=True)):
        def on_data(msg: Any, rank: int = rank, port: CollectivePort = port) -> None:
            why = port.accept(msg, nodes, rank)
            if why is not None:
                refused.append(why)
        bus.subscribe(topics.data(bus.sender.node, svc), on_data, schemas=(CollectiveTensor,), plane="data")
        announce(bus)
    for bus in buses:
        for node in nodes:
            bus.peers.wait_for(node, svc, timeout_s=10)
    return nodes, exchanges, ports, refused


class Delay:
    """Hands each send to the real one ``latency_s`` after it was made (in flight: sends overlap), per rank."""

    def __init__(self, latency_s: float) -> None:
        import queue
        self.latency_s = latency_s
        self.q: Any = queue.Queue()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def wrap(self, factory: Any) -> Any:
        def f(c: int) -> Any:
            send, recv = factory(c)
            if self.latency_s <= 0:
                return send, recv
            return (lambda to, step, t: self.q.put((time.monotonic() + self.latency_s, send, (to, step, t)))), recv
        return f

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            due, fn, args = item
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            fn(*args)


@pytest.mark.parametrize("latency", [0.0, 1.5e-3])
@pytest.mark.parametrize("n", [3, 4])
def test_mosquitto(n: int, latency: float, make_bus: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    nodes, exchanges, ports, refused = _ports(make_bus, n, "m")
    out = {}
    base = 0
    delays = [Delay(latency) for _ in range(n)]
    try:
        for label, rule in (("ring", lambda rows, parts: False), ("direct", REAL),
                            ("ring2", lambda rows, parts: False), ("direct2", REAL)):
            monkeypatch.setattr(layer, "direct_syncs", rule)
            off = base

            def rings(r: int, scope: int, off: int = off) -> Any:
                return delays[r].wrap(lambda c: ports[r].ring(nodes, r, off + scope, collective=c, qos=0,
                                                              deadline_s=5.0))

            out[label] = _time_steps(n, rings, lambda r, scope, off=off: ports[r].forget(off + scope))
            base += 100
    finally:
        for d in delays:
            d.q.put(None)
        for x in exchanges:
            x.close(timeout_s=1.0)
    assert not refused
    assert out["ring"]["tokens"] == out["direct"]["tokens"]
    print(f"\nMOSQUITTO D={n} +{latency * 1e3:.1f} ms emulated per message, {CFG.layers} layers h={CFG.hidden}: "
          + "; ".join(f"{k} median {v['median_ms']:.1f} ms min {v['min_ms']:.1f} ms comm {v['comm_share']:.0%}"
                      for k, v in out.items()))


def _time_all_reduce(label: str, ports: list[CollectivePort], nodes: list[str], h: int,
                     reps: int) -> tuple[float, float, float]:
    """Median and least ms of one AllReduce of ``h`` floats held by rank 0's row (rows 1, 0, 0, ...), and the
    process's CPU ms per AllReduce."""
    import os

    from edgeswarm.runtime.collectives import direct_all_reduce, ring_all_reduce

    n = len(nodes)
    bounds = [(0, h)] + [(h, h)] * (n - 1)  # a decode row's ring: rows 1, 0, 0, ...
    barrier = threading.Barrier(n)
    times: list[float] = []

    def body(r: int) -> None:
        x = torch.randn(h)
        for i in range(reps):
            scope = sum(map(ord, label)) * 1000 + i
            send, recv = ports[r].ring(nodes, r, scope, qos=0, deadline_s=5.0)
            barrier.wait()
            t0 = time.perf_counter()
            if label.startswith("ring"):
                ring_all_reduce(x, r, bounds, send, recv)
            else:
                direct_all_reduce(x, r, n, send, recv)
            barrier.wait()
            if r == 0:
                times.append(time.perf_counter() - t0)
            ports[r].forget(scope)

    c0 = os.times()
    in_threads(n, body)
    c1 = os.times()
    cpu = (c1.user - c0.user + c1.system - c0.system) / reps
    return statistics.median(times) * 1e3, min(times) * 1e3, cpu * 1e3


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collective_alone_over_mosquitto(n: int, make_bus: Callable[..., Any]) -> None:
    nodes, exchanges, ports, _ = _ports(make_bus, n, "c")
    h = 1280
    res = {}
    try:
        for label in ("ring", "direct", "ring2", "direct2"):
            res[label] = _time_all_reduce(label, ports, nodes, h, reps=60)
    finally:
        for x in exchanges:
            x.close(timeout_s=1.0)
    print(f"\nALLREDUCE of one row ({h} floats) over Mosquitto, D={n}: " + "; ".join(
        f"{k} median {a:.2f} ms min {b:.2f} ms process-cpu {c:.2f} ms" for k, (a, b, c) in res.items()))
