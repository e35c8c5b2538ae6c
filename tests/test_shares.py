"""Per-sender shares of shared limits (edgeswarm.shares) and where they are used: the checkpoint store's upload
tracker (open uploads and the bytes they hold) and the bounded request queue of a QueueWorker.

The attack each guards against: one member fills a limit every member shares (commits whose tensors never come,
queued requests) and the others are answered ``busy`` for as long as it keeps at it. With a share, that member is
refused once its own share is full and every other member still gets the rest.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import edgeswarm.messages as m
from edgeswarm.checkpoints.uploads import FailedUpload, ReadyUpload, UploadTracker
from edgeswarm.metrics import Metrics
from edgeswarm.queue_worker import QueueWorker
from edgeswarm.shares import SharedLimit, default_share
from edgeswarm.wire import WireTensor
from helpers import wait_until


def test_one_sender_takes_at_most_its_share_and_the_rest_stays_for_the_others() -> None:
    limit = SharedLimit(10, 4)
    assert limit.take("flood", 4) is None
    why = limit.take("flood", 1)
    assert why is not None and (why.kind, why.held, why.limit) == ("share", 4, 4)
    assert "flood already holds 4 uploads, its share (4" in why.describe("uploads")
    assert limit.held("flood") == 4 and limit.total == 4, "a refused take takes nothing"
    for sender in ("a", "b"):
        assert limit.take(sender, 3) is None
    why = limit.take("c", 1)
    assert why is not None and (why.kind, why.held, why.limit) == ("capacity", 10, 10)
    assert limit.refusal("c", 0) is None and limit.take("c", 0) is None and limit.senders == 3, \
        "taking nothing always fits and remembers no sender"
    limit.release("a", 3)
    assert limit.take("c", 1) is None and limit.senders == 3
    limit.release("flood", 99)  # never below what it holds
    assert limit.held("flood") == 0 and limit.total == 4 and limit.senders == 2
    with pytest.raises(ValueError):
        limit.take("a", -1)
    with pytest.raises(ValueError):
        SharedLimit(0, 1)


def test_a_share_of_the_whole_capacity_reports_the_capacity() -> None:
    limit = SharedLimit(3, 5)
    assert limit.share == 3 and limit.take("only", 3) is None
    why = limit.take("only", 1)
    assert why is not None and why.kind == "capacity"
    assert default_share(64) == 16 and default_share(3) == 1


def test_shares_hold_under_threads() -> None:
    limit = SharedLimit(1000, 100)
    taken = {f"s{i}": 0 for i in range(8)}

    def grab(sender: str) -> None:
        for _ in range(500):
            if limit.take(sender, 1) is None:
                taken[sender] += 1

    threads = [threading.Thread(target=grab, args=(s,)) for s in taken]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(n == 100 for n in taken.values()) and limit.total == 800


def commit(tid: str, count: int = 1, nbytes: int = 10, meta: dict | None = None) -> m.CheckpointCommit:  # type: ignore[type-arg]
    return m.CheckpointCommit(transfer_id=tid, job_id="job", stage="0", version=1, count=count, nbytes=nbytes,
                              meta=meta or {})


def tensor(tid: str, index: int = 0, count: int = 1) -> m.CheckpointTensor:
    return m.CheckpointTensor(transfer_id=tid, job_id="job", stage="0", version=1, name=f"t{index}", index=index,
                              count=count)


def wt(n: int) -> WireTensor:
    return WireTensor("uint8", np.zeros(n, np.uint8))


def test_commits_without_tensors_from_one_sender_fill_only_its_share_of_the_open_uploads() -> None:
    """The exact flood: 100 commits whose tensors never come, from one member. It holds its 16 uploads; the 84
    others are answered busy naming its share; a genuine member's save still opens, completes and is ready."""
    tracker: UploadTracker[str] = UploadTracker(max_upload_bytes=1000, max_pending_bytes=2000, timeout_s=30.0,
                                                max_open_uploads=64, max_sender_uploads=16, max_sender_bytes=1000)
    refused = []
    for i in range(100):
        refused += tracker.commit(commit(f"flood-{i}"), f"tok-{i}", now=0.0, sender="rogue")
    assert len(refused) == 84 and all(isinstance(f, FailedUpload) and f.reason == "busy" for f in refused)
    assert "rogue already holds 16 uploads open, its share" in refused[0].detail
    assert "EDGESWARM_CHECKPOINT_MAX_OPEN_UPLOADS_PER_SENDER = 16" in refused[0].detail
    assert tracker.sender_uploads("rogue") == 16 and tracker.open_uploads == 16
    assert tracker.commit(commit("genuine"), "tok-g", now=1.0, sender="pi-1") == []
    [ready] = tracker.tensor(tensor("genuine"), wt(10), now=1.0, sender="pi-1")
    assert isinstance(ready, ReadyUpload) and ready.sender == "pi-1" and ready.token == "tok-g"
    # Once the flood's uploads time out, its share is free again: nothing leaks.
    expired = tracker.expire(now=40.0)
    assert len(expired) == 16 and tracker.open_uploads == 0 and tracker.sender_uploads("rogue") == 0


def test_one_senders_bytes_fill_only_its_share_of_the_upload_memory() -> None:
    tracker: UploadTracker[str] = UploadTracker(max_upload_bytes=100, max_pending_bytes=200, timeout_s=30.0,
                                                max_sender_bytes=100)
    assert tracker.tensor(tensor("r1", 0, 2), wt(90), now=0.0, sender="rogue") == []
    [busy] = tracker.tensor(tensor("r2", 0, 2), wt(20), now=0.0, sender="rogue")
    assert busy.reason == "busy" and "rogue already holds 90 bytes" in busy.detail and "per sender" in busy.detail
    # Its meta counts against its own share too, not the others'.
    [busy] = tracker.commit(commit("r3", meta={"note": "x" * 40}), "tok", now=0.0, sender="rogue")
    assert busy.reason == "busy"
    assert tracker.sender_bytes("rogue") == 90
    # Another member still has the rest: a 100-byte upload fits.
    assert tracker.tensor(tensor("g", 0, 2), wt(50), now=0.0, sender="pi-1") == []
    assert tracker.commit(commit("g", 2, 100), "tok-g", now=0.0, sender="pi-1") == []
    [ready] = tracker.tensor(tensor("g", 1, 2), wt(50), now=0.0, sender="pi-1")
    assert isinstance(ready, ReadyUpload) and tracker.pending_bytes == 90 and tracker.sender_bytes("pi-1") == 0


def test_a_queue_worker_takes_at_most_a_share_of_its_queue_from_one_sender() -> None:
    gate = threading.Event()
    served: list[str] = []

    def serve(item: str) -> None:
        gate.wait(10)
        served.append(item)

    worker: QueueWorker[str] = QueueWorker("share-test", 8, serve, Metrics(), share=3)
    try:
        assert worker.offer_from("rogue", "r0") is None
        wait_until(lambda: worker.depth == 0, 5, message="the first item being served")  # it holds its place
        assert worker.offer_from("rogue", "r1") is None and worker.offer_from("rogue", "r2") is None
        why = worker.offer_from("rogue", "r3")
        assert why is not None and why.kind == "share" and why.held == 3
        for i in range(6):
            assert worker.offer_from(f"pi-{i % 2}", f"g{i}") is None
        why = worker.offer_from("pi-2", "late")
        assert why is not None and why.kind == "capacity", "the queue itself is still bounded"
        gate.set()
        wait_until(lambda: worker.idle, 10, message="everything served")
        assert served == ["r0", "r1", "r2", *(f"g{i}" for i in range(6))]
        assert worker.offer_from("rogue", "again") is None, "served items give their places back"
    finally:
        gate.set()
        worker.stop()


def test_one_senders_qos0_flood_fills_only_half_of_an_inbox_shard() -> None:
    """Heartbeats are QoS 0: a member flooding its own heartbeat topics used to fill the shard they share with
    other nodes' heartbeats, which were then dropped (and their nodes turned suspect)."""
    from edgeswarm.bus.bus import _sender_of
    from edgeswarm.bus.inbox import Inbox
    from edgeswarm.bus.mqtt import InboundMessage

    gate = threading.Event()
    handled: list[str] = []
    dropped: list[str] = []

    def handle(msg: InboundMessage) -> None:
        gate.wait(10)
        handled.append(msg.topic)

    def message(topic: str, qos: int = 0) -> InboundMessage:
        return InboundMessage(topic=topic, payload=b"", qos=qos)

    inbox = Inbox("share-test", 1, 16, handle, Metrics(), on_drop=lambda msg, _depth: dropped.append(msg.topic),
                  sender_of=_sender_of)
    try:
        inbox.put(message("edgeswarm/node/other/node-agent/heartbeat"))  # taken by the worker, which waits
        wait_until(lambda: inbox.depth == 0, 5, message="the first message being handled")
        for i in range(40):  # many topics, one writer: its share is counted by node, not by topic
            inbox.put(message(f"edgeswarm/node/mallory/svc-{i}/heartbeat"))
        assert len(dropped) == 32 and inbox.depth == 8
        for node in ("pi-1", "pi-2", "pi-3"):
            inbox.put(message(f"edgeswarm/node/{node}/node-agent/heartbeat"))
        inbox.put(message("edgeswarm/node/hub/planner/request/mallory", qos=1))  # QoS 1: the broker's window
        assert len(dropped) == 32 and inbox.depth == 12, "the others' heartbeats still fit"
        gate.set()
        wait_until(lambda: len(handled) == 13, 10, message="everything queued handled")
        inbox.put(message("edgeswarm/node/mallory/svc-0/heartbeat"))
        wait_until(lambda: len(handled) == 14, 10, message="a handled message gives its place back")
    finally:
        gate.set()
        inbox.stop()


def test_queue_shares_leave_half_of_a_request_queue_and_its_bytes_to_the_others() -> None:
    from edgeswarm.shares import QueueShares

    shares = QueueShares(8, max_bytes=1000)
    for _ in range(4):
        assert shares.take("rogue", 10) is None
    assert "rogue already holds 4 requests waiting, its share (4" in (shares.take("rogue", 10) or "")
    assert shares.take("pi-1", 600) is not None, "more than half the bytes"
    assert shares.take("pi-1", 500) is None and shares.take("pi-2", 10) is None
    shares.release("rogue", 10)
    assert shares.take("rogue", 10) is None
