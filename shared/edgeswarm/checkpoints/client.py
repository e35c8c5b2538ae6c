"""Saving and loading checkpoints through a checkpoint-store service, over any service's bus.

``save_checkpoint`` sends each tensor to the store's data topic (chunked by the bus) and then commits;
``load_checkpoint`` asks the store to stream a version's tensors to this bus's own data topic and
collects them; ``list_checkpoints`` asks which versions exist. Every wait is bounded by ``timeout_s``
(the whole call's budget, in seconds) and ends in a CheckpointError saying what did not happen.

Loading needs the caller's bus to belong to a service that advertises its status (every Service does):
the store sends the tensors to the data-plane broker that status names. The first load on a bus
subscribes it to ``edgeswarm/node/{node}/{service}/data`` for CheckpointTensor messages only, so a
service that also receives other tensors there should subscribe to its own schemas explicitly.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.errors import (
    BusError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointForbiddenError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointTooLargeError,
    CheckpointTransferError,
    CheckpointValueError,
    CheckpointVersionError,
    InvalidMessageError,
)
from edgeswarm.messages.checkpoints import (
    CheckpointCommit,
    CheckpointFailed,
    CheckpointList,
    CheckpointListing,
    CheckpointLoad,
    CheckpointLoaded,
    CheckpointMissing,
    CheckpointSaved,
    CheckpointTensor,
)
from edgeswarm.messages.liveness import RequestRejected
from edgeswarm.values.checkpoints import (
    MAX_TENSORS,
    CheckpointInfo,
    TensorEntry,
    TensorLike,
    as_wire,
    check_meta,
    check_name,
    check_tensor_name,
    check_version,
    sendable,
    stage_name,
)
from edgeswarm.wire import Message, WireTensor
from edgeswarm.wire.schema import new_id

log = logging.getLogger(__name__)

STORE_SERVICE = "checkpoint-store"
DEFAULT_TIMEOUT_S = 60.0
STORE_POLL_S = 0.1  # how often a wait for the store checks that it is still there

_ERRORS: dict[str, type[CheckpointError]] = {
    "corrupt": CheckpointCorruptError,
    "too_large": CheckpointTooLargeError,
    "stale_version": CheckpointVersionError,
    "forbidden": CheckpointForbiddenError,
}


class _Download:
    """The tensors of one load as they arrive, by index."""

    def __init__(self) -> None:
        self.tensors: dict[int, tuple[CheckpointTensor, WireTensor]] = {}
        self._cv = threading.Condition()

    def add(self, body: CheckpointTensor, tensor: WireTensor) -> None:
        with self._cv:
            self.tensors.setdefault(body.index, (body, tensor))
            self._cv.notify_all()

    def wait(self, count: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while len(self.tensors) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(remaining)
            return True


class CheckpointClient:
    """Checkpoint operations over one bus; thread-safe. ``client_for(bus)`` gives the bus's one instance."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._downloads: dict[str, _Download] = {}
        self._lock = threading.Lock()
        self._attached = False

    # --- save ---------------------------------------------------------------------------------------

    def save(self, store_node: str, job_id: str, stage: str | int, version: int, tensors: Mapping[str, TensorLike],
             *, meta: Mapping[str, Any] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> CheckpointInfo:
        """Store ``tensors`` (name -> numpy array, torch tensor or WireTensor) as ``version`` of (job, stage).

        Returns the stored version's info once it is on the store's disk. Raises CheckpointValueError
        (bad names, dtype or meta), CheckpointVersionError (older than every kept version),
        CheckpointTooLargeError, CheckpointTransferError (store unreachable, busy, upload incomplete) or
        CheckpointTimeoutError (no answer within ``timeout_s`` seconds).
        """
        deadline = time.monotonic() + timeout_s
        job_id, stage, version = check_name(job_id, "job id"), stage_name(stage), check_version(version)
        meta = check_meta(meta)
        if len(tensors) > MAX_TENSORS:
            raise CheckpointValueError(f"{len(tensors)} tensors; a checkpoint holds at most {MAX_TENSORS}")
        items = [(check_tensor_name(name), *as_wire(value, name)) for name, value in tensors.items()]
        transfer_id = new_id()
        count = len(items)
        what = f"{job_id}/{stage} version {version}"
        for index, (name, dtype, storage) in enumerate(items):
            body = CheckpointTensor(transfer_id=transfer_id, job_id=job_id, stage=stage, version=version, name=name,
                                    index=index, count=count)
            try:
                self.bus.send_tensor(store_node, STORE_SERVICE, body, sendable(dtype, storage),
                                     timeout_s=_remaining(deadline, f"saving {what}", timeout_s))
            except BusError as exc:
                raise CheckpointTransferError(f"cannot send tensor {name!r} of {what} to the {STORE_SERVICE} on "
                                              f"{store_node}: {exc}") from exc
        commit = CheckpointCommit(transfer_id=transfer_id, job_id=job_id, stage=stage, version=version, count=count,
                                  nbytes=sum(s.nbytes for _, _, s in items), meta=meta)
        reply = self._request(store_node, commit, deadline, f"saving {what}", timeout_s)
        if not isinstance(reply, CheckpointSaved):
            raise _failure(reply, store_node, f"saving {what}")
        log.debug("saved %s on %s: %d bytes, sha256 %s", what, store_node, reply.nbytes, reply.sha256)
        return CheckpointInfo(
            job_id=reply.job_id, stage=reply.stage, version=reply.version, created_at=reply.created_at, meta=meta,
            tensors=tuple(TensorEntry(name=n, dtype=d, shape=tuple(s.shape), nbytes=s.nbytes) for n, d, s in items),
            nbytes=reply.nbytes, file_bytes=reply.file_bytes, sha256=reply.sha256)

    # --- load ---------------------------------------------------------------------------------------

    def load(self, store_node: str, job_id: str, stage: str | int, version: int | None = None, *,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[CheckpointInfo, dict[str, np.ndarray]]:
        """``version`` (None: the latest) of (job, stage) from the store on ``store_node``.

        Returns its info and name -> array in save order (bfloat16 as uint16 bits; ``info.tensors``
        names each dtype and ``edgeswarm.checkpoints.as_torch`` restores them). Raises
        CheckpointNotFoundError, CheckpointCorruptError (the stored file fails its checksum),
        CheckpointTransferError or CheckpointTimeoutError (``timeout_s`` seconds in all).
        """
        deadline = time.monotonic() + timeout_s
        job_id, stage = check_name(job_id, "job id"), stage_name(stage)
        if version is not None:
            version = check_version(version)
        what = f"{job_id}/{stage} " + ("latest version" if version is None else f"version {version}")
        self._attach()
        transfer_id = new_id()
        download = _Download()
        with self._lock:
            self._downloads[transfer_id] = download
        try:
            reply = self._request(store_node, CheckpointLoad(transfer_id=transfer_id, job_id=job_id, stage=stage,
                                                             version=version), deadline, f"loading {what}", timeout_s)
            if not isinstance(reply, CheckpointLoaded):
                raise _failure(reply, store_node, f"loading {what}")
            if not download.wait(reply.count, max(0.0, deadline - time.monotonic())):
                raise CheckpointTimeoutError(
                    f"loading {what} from {store_node}: {len(download.tensors)} of {reply.count} tensors arrived "
                    f"within {timeout_s:g} s; is this service's data-plane broker reachable from the store?")
            return self._assemble(reply, download, store_node)
        finally:
            with self._lock:
                self._downloads.pop(transfer_id, None)

    def _assemble(self, reply: CheckpointLoaded, download: _Download,
                  store_node: str) -> tuple[CheckpointInfo, dict[str, np.ndarray]]:
        arrays: dict[str, np.ndarray] = {}
        entries = []
        for index in range(reply.count):
            body, tensor = download.tensors[index]
            if (body.job_id, body.stage, body.version) != (reply.job_id, reply.stage, reply.version) or \
                    body.name in arrays:
                raise CheckpointTransferError(f"the {STORE_SERVICE} on {store_node} sent tensor {body.name!r} of "
                                              f"{body.job_id}/{body.stage} version {body.version} for "
                                              f"{reply.job_id}/{reply.stage} version {reply.version}")
            arr = tensor.array if tensor.array.flags.writeable else tensor.array.copy()
            arrays[body.name] = arr
            entries.append(TensorEntry(name=body.name, dtype=tensor.dtype, shape=tensor.shape, nbytes=tensor.nbytes))
        nbytes = sum(e.nbytes for e in entries)
        if nbytes != reply.nbytes:
            raise CheckpointTransferError(f"the {STORE_SERVICE} on {store_node} sent {nbytes} bytes of tensors for "
                                          f"{reply.job_id}/{reply.stage} version {reply.version}, which holds "
                                          f"{reply.nbytes}")
        info = CheckpointInfo(job_id=reply.job_id, stage=reply.stage, version=reply.version,
                              created_at=reply.created_at, meta=reply.meta, tensors=tuple(entries), nbytes=nbytes,
                              file_bytes=reply.file_bytes, sha256=reply.sha256)
        return info, arrays

    # --- list ---------------------------------------------------------------------------------------

    def listing(self, store_node: str, job_id: str | None = None, *,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, dict[str, list[int]]]:
        """job id -> stage -> stored versions (ascending) on the store on ``store_node``, for one job or all."""
        deadline = time.monotonic() + timeout_s
        if job_id is not None:
            job_id = check_name(job_id, "job id")
        reply = self._request(store_node, CheckpointList(job_id=job_id), deadline, "listing checkpoints", timeout_s)
        if not isinstance(reply, CheckpointListing):
            raise _failure(reply, store_node, "listing checkpoints")
        out: dict[str, dict[str, list[int]]] = {}
        for entry in reply.entries:
            out.setdefault(entry.job_id, {})[entry.stage] = list(entry.versions)
        return out

    # --- plumbing -----------------------------------------------------------------------------------

    def _request(self, store_node: str, message: Message, deadline: float, what: str, timeout_s: float) -> Message:
        """Ask the store and wait for its answer; gives up at once when the store goes away meanwhile (its
        status turns offline or a new instance starts: the request, or the tensors before it, are lost)."""
        asked = self.bus.peers.get(store_node, STORE_SERVICE)
        exp = self.bus.expect()
        remaining = _remaining(deadline, what, timeout_s)
        try:
            self.bus.publish(topics.request(store_node, STORE_SERVICE), message, ttl_s=remaining,
                             correlation_id=exp.correlation_id, reply_to=self.bus.reply_topic, timeout_s=remaining)
        except BusError as exc:
            exp.wait(0)
            raise CheckpointTransferError(f"{what}: cannot reach the {STORE_SERVICE} on {store_node}: {exc}") from exc
        while not exp.arrives_within(STORE_POLL_S) and time.monotonic() < deadline:
            now = self.bus.peers.get(store_node, STORE_SERVICE)
            if asked is not None and now is not None and (now.state == "offline" or now.instance != asked.instance):
                exp.wait(0)
                raise CheckpointTransferError(f"{what}: the {STORE_SERVICE} on {store_node} went away before it "
                                              "answered (stopped or restarted); try again once it is back")
        reply = exp.wait(0)
        if exp.refusal is not None:
            raise CheckpointForbiddenError(f"{what}: the broker refused to carry it to the {STORE_SERVICE} on "
                                           f"{store_node} ({exp.refusal}); this node may not send it requests")
        if reply is None:
            raise CheckpointTimeoutError(
                f"{what}: the {STORE_SERVICE} on {store_node} did not answer within {timeout_s:g} s; is it running? "
                "(`edgeswarm status`)")
        return reply.body

    def _attach(self) -> None:
        with self._lock:
            if self._attached:
                return
            self._attached = True
        sender = self.bus.sender
        self.bus.subscribe(topics.data(sender.node, sender.service), self._on_tensor, schemas=(CheckpointTensor,),
                           plane="data")

    def _on_tensor(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, CheckpointTensor)
        if msg.tensor is None:
            raise InvalidMessageError(f"checkpoint tensor {body.name!r} from {msg.sender} carries no tensor")
        with self._lock:
            download = self._downloads.get(body.transfer_id)
        if download is None:
            self.bus.metrics.count("late_checkpoint_tensors")
            log.debug("dropped checkpoint tensor %r of transfer %s from %s: no load waits for it", body.name,
                      body.transfer_id, msg.sender)
            return
        download.add(body, msg.tensor)


@contextmanager
def loader_status(bus: Bus) -> Iterator[None]:
    """Let a command-line client's ``bus`` load checkpoints in the block: a store streams a load to the data-plane
    broker its caller's status names, and a client has none, so an online status is published for the block (not
    retained: only the services listening meanwhile need it) and an offline one after it."""
    from edgeswarm import __version__
    from edgeswarm.messages.liveness import Status

    s = bus.sender

    def status(state: Literal["online", "offline"]) -> Status:
        return Status(state=state, node=s.node, service=s.service, instance=s.instance, version=__version__,
                      host=socket.gethostname()[:255], pid=os.getpid(), device_class="client", memory_budget_bytes=0,
                      free_memory_bytes=0, data_url=bus.data.url,
                      heartbeat_interval_s=bus.settings.heartbeat_interval_s, started_at=started)

    started = time.time()
    bus.publish(topics.status(s.node, s.service), status("online"))
    try:
        yield
    finally:
        try:
            bus.publish(topics.status(s.node, s.service), status("offline"), timeout_s=2.0)
        except BusError as exc:
            log.debug("could not publish the loader's offline status: %s", exc)


def _remaining(deadline: float, what: str, timeout_s: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise CheckpointTimeoutError(f"{what} did not finish within {timeout_s:g} s")
    return remaining


def _failure(reply: Message, store_node: str, what: str) -> CheckpointError:
    """The exception for an answer that is not the one hoped for."""
    if isinstance(reply, CheckpointMissing):
        return CheckpointNotFoundError(f"{what} from {store_node}: {reply.detail}")
    if isinstance(reply, CheckpointFailed):
        cls = _ERRORS.get(reply.reason, CheckpointTransferError)
        return cls(f"{what} on {store_node} failed ({reply.reason}): {reply.detail}")
    if isinstance(reply, RequestRejected):
        return CheckpointTransferError(f"{what}: the {STORE_SERVICE} on {store_node} refused it ({reply.reason}): "
                                       f"{reply.detail}")
    return CheckpointTransferError(f"{what}: the {STORE_SERVICE} on {store_node} answered with an unexpected "
                                   f"{reply.SCHEMA}")


_CLIENTS: weakref.WeakKeyDictionary[Bus, CheckpointClient] = weakref.WeakKeyDictionary()
_CLIENTS_LOCK = threading.Lock()


def client_for(bus: Bus) -> CheckpointClient:
    """The CheckpointClient of ``bus`` (one per bus, so its data-topic subscription is made once)."""
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(bus)
        if client is None:
            client = _CLIENTS[bus] = CheckpointClient(bus)
        return client


def save_checkpoint(bus: Bus, store_node: str, job_id: str, stage: str | int, version: int,
                    tensors: Mapping[str, TensorLike], *, meta: Mapping[str, Any] | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> CheckpointInfo:
    """Save ``tensors`` as ``version`` of (job, stage) on the checkpoint store of ``store_node``.

    See CheckpointClient.save for the errors; ``timeout_s`` bounds the whole call, in seconds.
    """
    return client_for(bus).save(store_node, job_id, stage, version, tensors, meta=meta, timeout_s=timeout_s)


def load_checkpoint(bus: Bus, store_node: str, job_id: str, stage: str | int, version: int | None = None, *,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[CheckpointInfo, dict[str, np.ndarray]]:
    """Load ``version`` (None: the latest) of (job, stage) from the checkpoint store of ``store_node``.

    See CheckpointClient.load for the result and the errors; ``timeout_s`` bounds the whole call.
    """
    return client_for(bus).load(store_node, job_id, stage, version, timeout_s=timeout_s)


def list_checkpoints(bus: Bus, store_node: str, job_id: str | None = None, *,
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, dict[str, list[int]]]:
    """job id -> stage -> versions stored on the checkpoint store of ``store_node`` (one job, or all)."""
    return client_for(bus).listing(store_node, job_id, timeout_s=timeout_s)
