"""The tensor-parallel runtime over the platform's real data plane: every rank's ring is a ``CollectivePort`` on a
``TensorExchange`` over Mosquitto (QoS 0 inside a pass, one exchange scope per pass), and greedy generation from the
sharded KV cache still equals one device token for token."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from edgeswarm import topics
from edgeswarm.hmp.layer import HmpRank, Ring
from edgeswarm.messages.collectives import CollectiveTensor
from edgeswarm.models.text import reference as ref
from edgeswarm.runtime.collective_exchange import CollectivePort
from edgeswarm.runtime.exchange import TensorExchange
from edgeswarm.values.text_model import PRESETS
from helpers import announce
from hmp_driver import in_threads, shares_for

SVC = "tensor-shard-test"
JOB = "hmp-job"


def test_generation_over_mosquitto_equals_one_device(make_bus: Callable[..., Any]) -> None:
    cfg = PRESETS["llama-tiny"]
    n = 3
    w = ref.init_weights(cfg, 91)
    prompt = torch.randint(0, cfg.vocab, (9,), generator=torch.Generator().manual_seed(9)).tolist()
    want = ref.generate(cfg, w, prompt, 4)
    shares = shares_for(cfg, "galaxy", n, "uneven")
    buses = [make_bus(f"shard{r}", SVC) for r in range(n)]
    nodes = [bus.sender.node for bus in buses]
    exchanges = [TensorExchange(bus, SVC, wait_s=10.0, name=f"shard{r}", scope_name="pass")
                 for r, bus in enumerate(buses)]
    ports = [CollectivePort(x, JOB, dtype=cfg.dtype) for x in exchanges]
    refused: list[Any] = []
    for rank, (bus, port) in enumerate(zip(buses, ports, strict=True)):
        def on_data(msg: Any, rank: int = rank, port: CollectivePort = port) -> None:
            why = port.accept(msg, nodes, rank)
            if why is not None:
                refused.append(why)
        bus.subscribe(topics.data(bus.sender.node, SVC), on_data, schemas=(CollectiveTensor,), plane="data")
        announce(bus)
    for bus in buses:
        for node in nodes:
            bus.peers.wait_for(node, SVC, timeout_s=10)
    ranks = [HmpRank(cfg, shares, r, w) for r in range(n)]
    produced: list[int] = []
    barrier = threading.Barrier(n, timeout=30)

    def ring_of(rank: int, scope: int) -> Ring:
        return lambda c: ports[rank].ring(nodes, rank, scope, collective=c, qos=0, deadline_s=5.0)

    def body(rank: int) -> None:
        cache = ranks[rank].new_cache()
        ids, scope = list(prompt), 1
        while True:
            out = ranks[rank].forward(ids, ring_of(rank, scope), cache=cache)
            ports[rank].forget(scope)
            logits = ranks[rank].next_logits(out)
            if logits is not None:
                produced.append(int(logits.argmax()))
            barrier.wait()
            token, done = produced[-1], len(produced) >= len(want)
            barrier.wait()
            if done:
                cache.free()
                return
            ids, scope = [token], scope + 1

    try:
        in_threads(n, body)
    finally:
        for rank in ranks:
            rank.close()
        for x in exchanges:
            x.close(timeout_s=1.0)
    assert produced == want
    assert not refused
    times = ranks[0].recorder.times()
    assert {t.layer for t in times} == {-1, 0, 1} and all(t.compute_s > 0 for t in times)
