"""Assembling checkpoint uploads that arrive as separate tensors plus a commit, in any order.

A pure core (no I/O; the caller passes the clock): the checkpoint-store service feeds it every
CheckpointTensor and CheckpointCommit and acts on what it returns. An upload is *ready* when its commit
and all ``count`` tensors are in; it *fails* when it is inconsistent (a tensor or commit that disagrees
with the rest of its upload), too large, over the memory budget, or idle for ``timeout_s`` seconds.
Memory is bounded: one upload holds at most ``max_upload_bytes`` of tensor data; all incomplete uploads
together hold at most ``max_pending_bytes`` of tensor data and commit metadata (a commit waiting for its
tensors keeps its meta, up to about a megabyte); at most ``max_open_uploads`` are open at once. Both limits are
shared by per-sender shares (``edgeswarm.shares``): one sender node holds at most ``max_sender_bytes`` of those
bytes and ``max_sender_uploads`` of those uploads, so a member that floods the store with commits whose tensors
never come fills only its own share and the others' saves go on. Beyond a limit a new tensor or commit is refused
as ``busy``. The outcome of the last ``remember`` finished uploads is
kept so that a commit arriving after its upload failed still gets the reason.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from edgeswarm.messages.checkpoints import CheckpointCommit, CheckpointFailureReason, CheckpointTensor
from edgeswarm.settings import DEFAULT_MAX_OPEN_UPLOADS
from edgeswarm.shares import Refusal, SharedLimit
from edgeswarm.values.checkpoints import MetaValue
from edgeswarm.wire.tensor import WireTensor

T = TypeVar("T")

_SCALAR_BYTES = 8  # what an int, float or bool meta value is counted as


def meta_nbytes(meta: dict[str, MetaValue]) -> int:
    """What a commit's ``meta`` is counted as while its upload is open, in bytes: its keys and string values
    encoded as UTF-8, 8 bytes per other value (a fair estimate of what it holds, and of its encoded size)."""
    return sum(len(k.encode()) + (len(v.encode()) if isinstance(v, str) else _SCALAR_BYTES) for k, v in meta.items())


@dataclass(frozen=True)
class ReadyUpload(Generic[T]):
    """A complete upload: its tensors in index order, the node that sent it, and the commit's ``token`` to
    answer."""

    transfer_id: str
    job_id: str
    stage: str
    version: int
    tensors: list[tuple[str, WireTensor]]
    meta: dict[str, str | int | float | bool]
    nbytes: int
    token: T
    sender: str = ""


@dataclass(frozen=True)
class FailedUpload(Generic[T]):
    """An upload that was dropped, with why; ``token`` is the commit to answer, None if none arrived yet."""

    transfer_id: str
    reason: CheckpointFailureReason
    detail: str
    token: T | None


Outcome = ReadyUpload[T] | FailedUpload[T]


@dataclass
class _Upload(Generic[T]):
    transfer_id: str
    job_id: str
    stage: str
    version: int
    count: int
    touched: float
    sender: str = ""  # the node whose upload this is: another sender's messages never join it
    tensors: dict[int, tuple[str, WireTensor]] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)
    nbytes: int = 0
    meta_bytes: int = 0  # the commit's meta, counted in pending_bytes like the tensors
    commit: CheckpointCommit | None = None
    token: T | None = None

    def key(self) -> tuple[str, str, int, int]:
        return self.job_id, self.stage, self.version, self.count

    def describe(self) -> str:
        return f"upload {self.transfer_id} of {self.job_id}/{self.stage} version {self.version}"


class UploadTracker(Generic[T]):
    """Uploads in progress. Thread-safe; ``now`` is any monotonic clock in seconds, sizes are bytes.
    ``max_sender_bytes`` and ``max_sender_uploads`` are one sender's shares of ``max_pending_bytes`` and
    ``max_open_uploads`` (None: the whole limit, no share)."""

    def __init__(self, *, max_upload_bytes: int, max_pending_bytes: int, timeout_s: float,
                 max_open_uploads: int = DEFAULT_MAX_OPEN_UPLOADS, remember: int = 1024,
                 max_sender_bytes: int | None = None, max_sender_uploads: int | None = None) -> None:
        self.max_upload_bytes = max_upload_bytes
        self.max_pending_bytes = max_pending_bytes
        self.max_open_uploads = max_open_uploads
        self.timeout_s = timeout_s
        self._remember = remember
        self._uploads: dict[str, _Upload[T]] = {}
        self._finished: OrderedDict[str, tuple[CheckpointFailureReason | None, str]] = OrderedDict()
        self._lock = threading.Lock()
        # Tensor data and commit meta of the open uploads, and the uploads open, each charged to its sender.
        self._bytes = SharedLimit(max_pending_bytes, max_sender_bytes or max_pending_bytes)
        self._open = SharedLimit(max_open_uploads, max_sender_uploads or max_open_uploads)
        self.max_sender_bytes = self._bytes.share
        self.max_sender_uploads = self._open.share
        self.ignored = 0  # tensors or duplicate deliveries of uploads that are no longer open
        self.foreign = 0  # messages that named another sender's upload

    @property
    def open_uploads(self) -> int:
        with self._lock:
            return len(self._uploads)

    @property
    def pending_bytes(self) -> int:
        """Bytes of tensor data and commit metadata the open uploads hold."""
        return self._bytes.total

    def sender_bytes(self, sender: str) -> int:
        """Bytes the open uploads of ``sender`` hold."""
        return self._bytes.held(sender)

    def sender_uploads(self, sender: str) -> int:
        """How many uploads ``sender`` has open."""
        return self._open.held(sender)

    # --- inputs -------------------------------------------------------------------------------------

    def tensor(self, msg: CheckpointTensor, value: WireTensor, now: float, sender: str = "") -> list[Outcome[T]]:
        """Feed one uploaded tensor from node ``sender``; returns what became of its upload (nothing while it is
        incomplete). A tensor naming another sender's upload is ignored: it can neither join nor fail it."""
        with self._lock:
            if msg.transfer_id in self._finished:
                self.ignored += 1
                return []
            up = self._uploads.get(msg.transfer_id)
            if up is not None and up.sender != sender:
                self.foreign += 1
                return []
            if up is None:
                refusal = self._open_upload(msg.transfer_id, sender, value.nbytes)
                if refusal is not None:
                    return [self._refuse(msg.transfer_id, "busy", refusal, None)]
                up = _Upload(msg.transfer_id, msg.job_id, msg.stage, msg.version, msg.count, now, sender)
                self._uploads[msg.transfer_id] = up
            if (msg.job_id, msg.stage, msg.version, msg.count) != up.key():
                return self._fail(up, "bad_request", (
                    f"{up.describe()}: tensor {msg.name!r} says {msg.job_id}/{msg.stage} version {msg.version} "
                    f"with {msg.count} tensors, the upload says {up.count}"))
            held = up.tensors.get(msg.index)
            if held is not None:
                if held[0] == msg.name:
                    self.ignored += 1  # delivered twice
                    return []
                return self._fail(up, "bad_request", f"{up.describe()}: tensors {held[0]!r} and {msg.name!r} "
                                                     f"both claim index {msg.index}")
            if msg.name in up.names:
                return self._fail(up, "bad_request", f"{up.describe()}: tensor name {msg.name!r} appears twice")
            if up.nbytes + value.nbytes > self.max_upload_bytes:
                return self._fail(up, "too_large", (
                    f"{up.describe()} exceeds {self.max_upload_bytes} bytes (EDGESWARM_CHECKPOINT_MAX_BYTES) at "
                    f"tensor {msg.name!r}"))
            full = self._bytes.take(sender, value.nbytes)
            if full is not None:
                return self._fail(up, "busy", f"{up.describe()}: {self._bytes_full(full)}")
            up.tensors[msg.index] = (msg.name, value)
            up.names.add(msg.name)
            up.nbytes += value.nbytes
            up.touched = now
            return self._maybe_ready(up)

    def commit(self, msg: CheckpointCommit, token: T, now: float, sender: str = "") -> list[Outcome[T]]:
        """Feed the commit of an upload from node ``sender``; ``token`` is handed back with the outcome to answer
        it. A commit naming another sender's upload is refused without touching that upload."""
        with self._lock:
            up = self._uploads.get(msg.transfer_id)
            if up is not None and up.sender != sender:
                self.foreign += 1
                return [FailedUpload(msg.transfer_id, "bad_request", f"upload {msg.transfer_id} is another "
                                     "sender's; pick a fresh transfer id", token)]
            finished = self._finished.get(msg.transfer_id)
            if finished is not None:
                reason, detail = finished
                if reason is None:
                    return [FailedUpload(msg.transfer_id, "bad_request",
                                         f"upload {msg.transfer_id} was already committed", token)]
                return [FailedUpload(msg.transfer_id, reason, detail, token)]
            if up is not None and up.commit is not None:
                self.ignored += 1
                return []
            meta = meta_nbytes(msg.meta)
            if up is None:
                refusal = self._open_upload(msg.transfer_id, sender, meta)
                if refusal is not None:
                    return [self._refuse(msg.transfer_id, "busy", refusal, token)]
                up = _Upload(msg.transfer_id, msg.job_id, msg.stage, msg.version, msg.count, now, sender)
                self._uploads[msg.transfer_id] = up
            up.commit, up.token = msg, token
            full = self._bytes.take(sender, meta)
            if full is not None:
                return self._fail(up, "busy", f"{up.describe()}: this commit's metadata: {self._bytes_full(full)}")
            up.meta_bytes = meta
            if (msg.job_id, msg.stage, msg.version, msg.count) != up.key():
                return self._fail(up, "bad_request", (
                    f"{up.describe()}: the commit says {msg.job_id}/{msg.stage} version {msg.version} with "
                    f"{msg.count} tensors, the tensors say {up.count}"))
            if msg.nbytes > self.max_upload_bytes:
                return self._fail(up, "too_large", (
                    f"{up.describe()} is {msg.nbytes} bytes; the store accepts at most {self.max_upload_bytes} "
                    "(EDGESWARM_CHECKPOINT_MAX_BYTES)"))
            up.touched = now
            return self._maybe_ready(up)

    def expire(self, now: float) -> list[Outcome[T]]:
        """Fail every upload idle for more than ``timeout_s``; returns those failures."""
        out: list[Outcome[T]] = []
        with self._lock:
            for up in [u for u in self._uploads.values() if now - u.touched > self.timeout_s]:
                missing = sorted(set(range(up.count)) - set(up.tensors))
                commit = "the commit and " if up.commit is None else ""
                out += self._fail(up, "incomplete", (
                    f"{up.describe()}: {commit}{len(missing)} of {up.count} tensors (indices "
                    f"{missing[:8]}{'...' if len(missing) > 8 else ''}) did not arrive within {self.timeout_s:g} s "
                    "of the last one; the upload was discarded. Send it again"))
        return out

    # --- internals (lock held) ----------------------------------------------------------------------

    def _maybe_ready(self, up: _Upload[T]) -> list[Outcome[T]]:
        if up.commit is None or len(up.tensors) < up.count:
            return []
        if up.nbytes != up.commit.nbytes:
            return self._fail(up, "bad_request", f"{up.describe()}: the commit declares {up.commit.nbytes} bytes, "
                                                 f"the tensors hold {up.nbytes}")
        self._close(up, None, "")
        return [ReadyUpload(up.transfer_id, up.job_id, up.stage, up.version,
                            [up.tensors[i] for i in range(up.count)], dict(up.commit.meta), up.nbytes,
                            up.token, up.sender)]  # type: ignore[arg-type]  # a commit always comes with its token

    def _fail(self, up: _Upload[T], reason: CheckpointFailureReason, detail: str) -> list[Outcome[T]]:
        self._close(up, reason, detail)
        return [FailedUpload(up.transfer_id, reason, detail, up.token)]

    def _open_upload(self, transfer_id: str, sender: str, nbytes: int) -> str | None:
        """Take a place for a new upload of ``sender`` whose first message brings ``nbytes``: None when taken (the
        bytes are charged by the caller), else why it cannot be opened now."""
        full = self._open.take(sender, 1)
        if full is not None:
            where = ("EDGESWARM_CHECKPOINT_MAX_OPEN_UPLOADS_PER_SENDER" if full.kind == "share"
                     else "EDGESWARM_CHECKPOINT_MAX_OPEN_UPLOADS")
            return (f"upload {transfer_id}: {full.describe('uploads open')} ({where} = {full.limit}); try again when "
                    "they are done")
        room = self._bytes.refusal(sender, nbytes)
        if room is not None:
            self._open.release(sender, 1)
            return f"upload {transfer_id}: {self._bytes_full(room)}"
        return None

    @staticmethod
    def _bytes_full(full: Refusal) -> str:
        where = ("per sender: EDGESWARM_CHECKPOINT_MAX_BYTES" if full.kind == "share"
                 else "in all: twice EDGESWARM_CHECKPOINT_MAX_BYTES")
        return (f"{full.describe('bytes of incomplete uploads (tensors and commit metadata)')} ({where}); try again "
                "when they are done")

    def _refuse(self, transfer_id: str, reason: CheckpointFailureReason, detail: str,
                token: T | None) -> FailedUpload[T]:
        # Remembered, so the refused upload's other messages are ignored and a later commit gets the reason.
        self._remember_outcome(transfer_id, reason, detail)
        return FailedUpload(transfer_id, reason, detail, token)

    def _close(self, up: _Upload[T], reason: CheckpointFailureReason | None, detail: str) -> None:
        if self._uploads.pop(up.transfer_id, None) is not None:
            self._open.release(up.sender, 1)
        self._bytes.release(up.sender, up.nbytes + up.meta_bytes)
        self._remember_outcome(up.transfer_id, reason, detail)

    def _remember_outcome(self, transfer_id: str, reason: CheckpointFailureReason | None, detail: str) -> None:
        self._finished[transfer_id] = (reason, detail)
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)
