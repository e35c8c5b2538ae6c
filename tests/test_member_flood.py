"""A misbehaving member cannot starve the others (issue 23, item 6), on a real Mosquitto broker.

One member, ``mallory``, floods the cluster the way the issue found it could: commits with no tensors to the
checkpoint store, over and over (each burst used to fill the store's 64 open uploads, so every genuine save was
answered ``busy`` until they timed out, and again at the next burst), and fake membership entries (instances of its
own node beyond the per-node cap, and statuses for nodes that are not it). Meanwhile a training job on two devices
saves a checkpoint every round. The job's saves all go through at once (no save is refused, none retried), the
flood is refused once mallory's own share is full, the coordinator's view holds the genuine nodes and a device
that joins during the flood, and none of mallory's fakes beyond its own node's share.

Also the writer binding of cluster events: the coordinator's ``edgeswarm/cluster/events`` is the hub's alone (the
generated ACL), a service's report about its own node goes to ``edgeswarm/node/{node}/{service}/events``, and a
report there that speaks for another node is dropped and counted as ``forged_sender``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import edgeswarm.messages as m
from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.bus.bus import check_writer
from edgeswarm.errors import WireError
from edgeswarm.local.broker import BrokerProcess
from edgeswarm.runtime.client import ClusterWatcher
from edgeswarm.security.acl import rules
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import DatasetSpec
from edgeswarm.wire import Sender
from helpers import wait_until

ROGUE = "mallory"
NODES = ["a", "b"]
ROUNDS = 4
MLP = ModelSpec(name="mlp", config={"hidden": 32, "layers": 3, "seed": 7})
DATA = DatasetSpec(kind="teacher", size=256, test_size=32)
BURST = 100  # commits with no tensors per burst, as the attack
INSTANCE_CAP = 16  # EDGESWARM_MEMBERSHIP_MAX_INSTANCES_PER_NODE's default


# --- the writer binding of cluster events ------------------------------------------------------------------

def event(node: str) -> m.ClusterEvent:
    return m.ClusterEvent(kind="duplicate_node", node=node, service="node-agent", instance="i1", detail="x", at=0.0)


def test_cluster_events_are_the_hubs_and_a_services_own_events_are_bound_to_its_node() -> None:
    hub = {(r.access, r.topic) for r in rules("hub", "hub")}
    for name, role in (("pi-1", "device"), ("mec-0", "edge"), ("alice", "client")):
        granted = {(r.access, r.topic) for r in rules(name, role)}
        assert ("write", topics.CLUSTER_EVENTS) not in granted, name
        assert not {t for a, t in granted if a == "write" and t.endswith("/events") and f"/{name}/" not in t}, name
    assert ("write", topics.CLUSTER_EVENTS) in hub and ("write", "edgeswarm/node/pi-1/+/events") in \
        {(r.access, r.topic) for r in rules("pi-1", "device")}

    own = topics.service_events("pi-1", "node-agent")
    assert topics.writer_of(own) == "pi-1" and topics.writer_of(topics.CLUSTER_EVENTS) is None
    envelope = Sender(node="pi-1", service="node-agent", instance="i1").envelope(event("pi-1"))
    check_writer(own, envelope, event("pi-1"))  # its own node: fine
    with pytest.raises(WireError) as caught:  # its own topic, but speaking for another node
        check_writer(own, envelope, event("pi-2"))
    assert caught.value.reason == "forged_sender"
    with pytest.raises(WireError) as caught:  # another node's topic
        check_writer(topics.service_events("pi-2", "node-agent"), envelope, event("pi-2"))
    assert caught.value.reason == "forged_sender"


def test_a_forged_service_event_is_dropped_and_counted(make_bus: Any) -> None:
    reader = make_bus("watcher", "cli")
    got: list[Inbound] = []
    reader.subscribe(topics.ALL_SERVICE_EVENTS, got.append, schemas=(m.ClusterEvent,))
    rogue = make_bus(ROGUE, "node-agent")
    rogue.publish(topics.service_events("pi-2", "node-agent"), event("pi-2"))  # another node's topic
    rogue.publish(topics.service_events(ROGUE, "node-agent"), event("pi-2"))  # its own topic, about another node
    rogue.publish(topics.service_events(ROGUE, "node-agent"), event(ROGUE))  # honest
    wait_until(lambda: got, 10, message="the honest event")
    wait_until(lambda: reader.metrics.counter("rejected.forged_sender") >= 2, 10, message="the forgeries counted")
    time.sleep(0.3)
    assert [g.body.node for g in got] == [ROGUE]


# --- the flood while a job trains --------------------------------------------------------------------------

def _cluster_and_plan() -> tuple[Any, Any]:
    from edgeswarm.planning.hpp.assemble import assemble_plan
    from edgeswarm.planning.hpp.costmodel import CostModel
    from edgeswarm.planning.hpp.types import PlanOptions
    from edgeswarm.profiling.compute import profile_model
    from edgeswarm.values.profiles import ClusterProfile, DeviceInfo, DeviceProfileEntry, LinkProfile

    model, compute = profile_model(MLP, [1, 8, 32], repeats=1, warmup=0)
    per_sample = [[1e-4 * b for b in compute.batch_sizes] for _ in compute.forward_s]
    compute = compute.model_copy(update={"forward_s": per_sample, "backward_s": per_sample})
    entries = [DeviceProfileEntry(device=DeviceInfo(node=n, fingerprint=n, memory_budget_bytes=2**30),
                                  compute=compute) for n in NODES]
    cluster = ClusterProfile(model=model, devices=entries,
                             links=[LinkProfile(src="a", dst="b", bandwidth_bps=12.5e6)])
    plan = assemble_plan(CostModel(cluster, PlanOptions(micro_batch_size=16, micro_batches=2, optimizer="momentum")),
                         [(0, 2, (0,)), (2, len(model.units), (1,))], "hpp")
    return cluster, plan


class Flood:
    """Mallory's attack: bursts of commits with no tensors to the store, and fake membership entries. One burst
    goes before the job and one after each of its saves (bursts timed by a clock could all miss a job that runs
    in under a second), so every save meets a store mallory has just flooded again."""

    def __init__(self, bus: Bus, reply_to: str) -> None:
        self.bus = bus
        self.reply_to = reply_to
        self.bursts = 0

    def burst(self) -> None:
        request = topics.request("hub", "checkpoint-store")
        n = self.bursts
        self.bursts += 1
        for i in range(BURST):
            commit = m.CheckpointCommit(transfer_id=f"flood-{n}-{i}", job_id="junk", stage="0", version=1, count=4,
                                        nbytes=64, meta={"note": "x" * 2000})
            self.bus.publish(request, commit, reply_to=self.reply_to, correlation_id=f"flood-{n}-{i}", ttl_s=60)
        # Fake membership: many instances of its own node (all a member can write on a secure cluster) and
        # statuses for nodes that are not it (its own envelope on their topics: dropped as forged).
        for i in range(2 * INSTANCE_CAP):
            self.bus.publish(topics.heartbeat(ROGUE, f"fake-{i}"), m.Heartbeat(
                node=ROGUE, service=f"fake-{i}", instance=f"x{n}-{i}", seq=0, interval_s=1.0, uptime_s=1.0,
                free_memory_bytes=1, inbox_depth=0), qos=0)
        for i in range(20):
            self.bus.publish(topics.heartbeat(f"fake-node-{n}-{i}", "node-agent"), m.Heartbeat(
                node=f"fake-node-{n}-{i}", service="node-agent", instance="x", seq=0, interval_s=1.0, uptime_s=1.0,
                free_memory_bytes=1, inbox_depth=0), qos=0)


def test_a_job_saves_every_checkpoint_while_one_member_floods_the_store_and_the_membership(
        broker: BrokerProcess, make_bus: Any, services: Any, tmp_path: Path) -> None:
    from edgeswarm.hpp.coordinator import JobObserver, JobResult, train_rounds
    from edgeswarm.hpp.driver import JobDriver
    from edgeswarm.hpp.spec import parse_job

    store_dir = tmp_path / "checkpoints"
    # Flooded uploads stay open for the whole job (they would time out after 30 s): every burst adds to them.
    store = services.start("checkpoint-store", "hub", broker.url, EDGESWARM_CHECKPOINT_DIR=str(store_dir),
                           EDGESWARM_REASSEMBLY_TIMEOUT_S="120")
    coordinator = services.start("coordinator", "hub", broker.url)
    workers = {n: services.start("stage-worker", n, broker.url) for n in NODES}
    client = make_bus("trainer", "cli")
    for node in NODES:
        client.peers.wait_for(node, "stage-worker", timeout_s=40)
    client.peers.wait_for("hub", "checkpoint-store", timeout_s=40)
    watcher = ClusterWatcher(make_bus("watch", "cli"))
    rogue = make_bus(ROGUE, "stage-worker")
    cluster, plan = _cluster_and_plan()
    job = parse_job({"name": "guarded", "model": MLP.model_dump(), "data": DATA.model_dump(), "global_batch": 32,
                     "micro_batches": 2, "optimizer": {"name": "momentum", "lr": 0.05, "momentum": 0.9},
                     "rounds": ROUNDS, "checkpoint_interval": 1})
    refused: list[Inbound] = []
    inbox = topics.reply(ROGUE, "flood", "inbox")  # the store's answers to the flood, all collected here
    rogue.subscribe(inbox, refused.append, schemas=(m.CheckpointFailed,))
    seen: list[str] = []

    flood = Flood(rogue, inbox)

    class Observer(JobObserver):
        def saved(self, version: int, saved: list[Any]) -> None:
            seen.append(f"saved {version}")
            flood.burst()

        def device_lost(self, failures: Any, round_index: int) -> None:
            seen.append(f"lost {sorted(failures)} in round {round_index}")

    flood.burst()  # before the job starts: its first save meets a store already flooded
    wait_until(lambda: len(refused) >= BURST - 16, 20, message="the first burst answered")
    late = services.start("node-agent", "late-device", broker.url)  # a genuine device joining mid-flood
    driver = JobDriver(client, job, plan, loss_terms=32, timeout_s=30)
    driver.deploy()
    result = JobResult(plan)
    train_rounds(driver, job, ROUNDS, cluster, "hub", result, Observer(), lambda: None)
    wait_until(lambda: _service_online(watcher, "late-device", "node-agent"), 30,
               message="the device that joined during the flood, in the coordinator's view")
    view, source = watcher.view()

    # Every checkpoint saved, in order, with no save refused (a busy save fails the stage: the job would show it).
    assert [saved[0].version for saved in result.saved] == list(range(1, ROUNDS + 1)), seen
    assert not [s for s in seen if s.startswith("lost")], seen
    for node, proc in workers.items():
        assert "saving stage" not in services.log_of(proc), (node, services.log_of(proc)[-2000:])
    # The flood was refused at mallory's share, not at the store's limit, burst after burst.
    assert flood.bursts == 1 + ROUNDS
    wait_until(lambda: len(refused) >= flood.bursts * (BURST - 16), 20, message="every burst refused past its share")
    details = {r.body.detail for r in refused if r.body.reason == "busy"}
    assert details and all("mallory already holds" in d and "its share" in d for d in details), list(details)[:3]
    # Membership: the genuine nodes are there; mallory holds no more than its own node's share; no fake node.
    assert source == "coordinator"
    assert {"a", "b", "hub", "late-device"} <= {n.node for n in view.nodes}
    assert not [n.node for n in view.nodes if n.node.startswith("fake-node")]
    mine = view.node(ROGUE)
    assert mine is not None and len(mine.services) <= INSTANCE_CAP
    assert store.poll() is None and coordinator.poll() is None and late.poll() is None


def _service_online(watcher: ClusterWatcher, node: str, service: str) -> bool:
    view, source = watcher.view()
    n = view.node(node)
    return source == "coordinator" and n is not None and any(s.service == service and s.state == "online"
                                                             for s in n.services)
