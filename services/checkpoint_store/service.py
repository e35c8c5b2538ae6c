"""The checkpoint store: keeps versioned model and optimizer state per job and stage, on the hub node.

A thin adapter over ``edgeswarm.checkpoints``: uploads (CheckpointTensor on
``edgeswarm/node/{node}/checkpoint-store/data`` plus a CheckpointCommit request) are assembled by an
UploadTracker; a complete one is written by the CheckpointStore (atomic, last EDGESWARM_CHECKPOINT_KEEP
versions kept) and the commit is answered with CheckpointSaved. A CheckpointLoad is answered by
streaming the version's tensors to the requester's data topic and then CheckpointLoaded, or by
CheckpointMissing / CheckpointFailed (a file that fails its checksum is reported, never sent). A
CheckpointList is answered with the stored versions.

Disk work (writes and loads) runs on one worker thread fed by a bounded queue, so the request topic,
and with it probes, stays responsive while a large checkpoint is written or sent; beyond ``MAX_QUEUED``
waiting jobs (``MAX_QUEUED_PER_SENDER`` of one sender node) a request is answered ``busy``, and so is a new upload
beyond EDGESWARM_CHECKPOINT_MAX_OPEN_UPLOADS open ones or beyond twice EDGESWARM_CHECKPOINT_MAX_BYTES of tensors and
commit metadata held. Each limit is shared by per-sender shares (``edgeswarm.shares``): one sender node may hold
EDGESWARM_CHECKPOINT_MAX_OPEN_UPLOADS_PER_SENDER uploads and EDGESWARM_CHECKPOINT_MAX_BYTES of those bytes, so a
member flooding the store with commits whose tensors never come is refused once its share is full while every
other member's saves go on. Uploads idle for
EDGESWARM_REASSEMBLY_TIMEOUT_S are discarded (and a waiting commit answered ``incomplete``). Every bad message is
logged, counted and answered where it can be (failed uploads are logged rate-limited: anyone can cause them); the
service goes on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from edgeswarm import topics
from edgeswarm.bus import Inbound
from edgeswarm.checkpoints.ownership import COORDINATOR, JobOwners, owners_of, refusal
from edgeswarm.checkpoints.store import CheckpointStore
from edgeswarm.checkpoints.uploads import FailedUpload, Outcome, ReadyUpload, UploadTracker
from edgeswarm.errors import (
    BusError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointTooLargeError,
    CheckpointValueError,
    CheckpointVersionError,
    EdgeswarmError,
    InvalidMessageError,
)
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.checkpoints import (
    CheckpointCommit,
    CheckpointFailed,
    CheckpointFailureReason,
    CheckpointList,
    CheckpointListing,
    CheckpointLoad,
    CheckpointLoaded,
    CheckpointMissing,
    CheckpointSaved,
    CheckpointTensor,
    StageVersions,
)
from edgeswarm.messages.jobs import JobState
from edgeswarm.queue_worker import QueueWorker
from edgeswarm.runtime.service import Service
from edgeswarm.values.checkpoints import sendable
from edgeswarm.wire import Message

log = logging.getLogger(__name__)

MAX_QUEUED = 16
# One sender node's share of the queue: a node queues a save per stage it holds, or loads them after a re-plan.
MAX_QUEUED_PER_SENDER = 8
EXPIRE_INTERVAL_S = 0.5
MAX_JOBS_FOLLOWED = 4096  # job states remembered for who-may-write; the oldest are forgotten first
OWNERS_WAIT_S = 2.0


@dataclass(frozen=True)
class _Save:
    upload: ReadyUpload[Inbound]


@dataclass(frozen=True)
class _Load:
    msg: Inbound
    request: CheckpointLoad


class CheckpointStoreService(Service):
    name = "checkpoint-store"

    def setup(self) -> None:
        s = self.settings
        self.store = CheckpointStore(s.checkpoint_dir, keep=s.checkpoint_keep, max_bytes=s.checkpoint_max_bytes)
        try:
            self.store.sweep_temp_files()  # before any write of ours can be in progress
        except OSError as exc:
            log.warning("cannot look for leftover temporary files in %s: %s", self.store.directory, exc)
        self.uploads: UploadTracker[Inbound] = UploadTracker(
            max_upload_bytes=s.checkpoint_max_bytes, max_pending_bytes=2 * s.checkpoint_max_bytes,
            timeout_s=s.reassembly_timeout_s, max_open_uploads=s.checkpoint_max_open_uploads,
            max_sender_bytes=s.checkpoint_max_bytes, max_sender_uploads=s.checkpoint_max_open_uploads_per_sender)
        self._failure_log = RateLimitedLog(log, what="failed uploads")
        self._jobs: QueueWorker[_Save | _Load] = QueueWorker("checkpoint-disk", MAX_QUEUED, self._work, self.metrics,
                                                          share=MAX_QUEUED_PER_SENDER)
        self.bus.subscribe(topics.data(self.node, self.name), self._on_tensor, schemas=(CheckpointTensor,),
                           plane="data")
        request = topics.request(self.node, self.name)
        self.bus.subscribe(request, self._on_commit, schemas=(CheckpointCommit,))
        self.bus.subscribe(request, self._on_load, schemas=(CheckpointLoad,))
        self.bus.subscribe(request, self._on_list, schemas=(CheckpointList,))
        self.every(EXPIRE_INTERVAL_S, self._expire, "expire-uploads")
        self._owners: OrderedDict[str, JobOwners] = OrderedDict()
        self._owners_changed = threading.Condition()
        self.bus.subscribe(topics.ALL_JOB_STATES, self._on_job_state, schemas=(JobState,))
        _warn_if_unwritable(self.store.directory)
        log.info("checkpoints in %s, keeping %d versions per job and stage, at most %d bytes each",
                 self.store.directory, s.checkpoint_keep, s.checkpoint_max_bytes)

    def teardown(self) -> None:
        self._jobs.stop()

    # --- uploads ------------------------------------------------------------------------------------

    def _on_tensor(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, CheckpointTensor)  # guaranteed by the subscription's schema filter
        if msg.tensor is None:
            raise InvalidMessageError(f"checkpoint tensor {body.name!r} of upload {body.transfer_id} from "
                                      f"{msg.sender} carries no tensor")
        self._act(self.uploads.tensor(body, msg.tensor, time.monotonic(), msg.envelope.sender_node))

    def _on_commit(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, CheckpointCommit)
        log.debug("commit of upload %s from %s: %s/%s version %d, %d tensors", body.transfer_id, msg.sender,
                  body.job_id, body.stage, body.version, body.count)
        self._act(self.uploads.commit(body, msg, time.monotonic(), msg.envelope.sender_node))

    def _expire(self) -> None:
        self._act(self.uploads.expire(time.monotonic()))
        self.metrics.gauge("checkpoint_upload_bytes", self.uploads.pending_bytes)
        self.metrics.gauge("checkpoint_uploads_open", self.uploads.open_uploads)

    def _act(self, outcomes: list[Outcome[Inbound]]) -> None:
        for outcome in outcomes:
            if isinstance(outcome, FailedUpload):
                self.metrics.count(f"checkpoint_failures.{outcome.reason}")
                # Rate-limited: anyone who can reach the broker can send a flood of commits that fail.
                self._failure_log.warning(outcome.reason, "checkpoint upload failed (%s): %s", outcome.reason,
                                          outcome.detail)
                if outcome.token is not None:
                    self._answer(outcome.token, CheckpointFailed(transfer_id=outcome.transfer_id,
                                                                 reason=outcome.reason, detail=outcome.detail[:4096]))
            else:
                self._enqueue(_Save(outcome), outcome.token, outcome.transfer_id)

    # --- loads and listings -------------------------------------------------------------------------

    def _on_load(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, CheckpointLoad)
        self._enqueue(_Load(msg, body), msg, body.transfer_id)

    def _on_list(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, CheckpointList)
        try:
            listing = self.store.listing(body.job_id)
        except OSError as exc:
            self._fail(msg, None, "error", f"cannot list {self.store.directory}: {exc}")
            return
        entries = [StageVersions(job_id=j, stage=s, versions=v) for j, stages in listing.items()
                   for s, v in stages.items()]
        self._answer(msg, CheckpointListing(entries=entries[:4096]))

    # --- the disk worker ----------------------------------------------------------------------------

    def _enqueue(self, job: _Save | _Load, msg: Inbound, transfer_id: str) -> None:
        full = self._jobs.offer_from(msg.envelope.sender_node, job)
        if full is not None:
            self._fail(msg, transfer_id, "busy", f"checkpoint writes and loads queued on {self.node}: "
                                                 f"{full.describe('of them')}; try again shortly")

    def _work(self, job: _Save | _Load) -> None:
        if isinstance(job, _Save):
            self._save(job.upload)
        else:
            self._load(job.msg, job.request)

    # --- who may write ------------------------------------------------------------------------------

    def _on_job_state(self, msg: Inbound) -> None:
        state = msg.body
        assert isinstance(state, JobState)
        if msg.envelope.sender_service != COORDINATOR or topics.job_of(msg.topic) != state.job_id:
            return  # only a coordinator's state of that very job says who owns it
        with self._owners_changed:
            self._owners[state.job_id] = owners_of(state, msg.envelope.sender_node)
            self._owners.move_to_end(state.job_id)
            while len(self._owners) > MAX_JOBS_FOLLOWED:
                self._owners.popitem(last=False)
            self._owners_changed.notify_all()

    def _refusal(self, up: ReadyUpload[Inbound]) -> str | None:
        """Why the upload's sender may not write its stage; waits a moment for a newer job state first, since a
        re-planned job's state and its next save travel on different topics and may arrive out of order."""
        deadline = time.monotonic() + OWNERS_WAIT_S
        with self._owners_changed:
            while True:
                why = refusal(self._owners.get(up.job_id), up.sender, up.job_id, up.stage)
                left = deadline - time.monotonic()
                if why is None or left <= 0 or not self._owners_changed.wait(left):
                    return why

    def _save(self, up: ReadyUpload[Inbound]) -> None:
        msg = up.token
        why = self._refusal(up)
        if why is not None:
            self._fail(msg, up.transfer_id, "forbidden", why)
            return
        try:
            info = self.store.put(up.job_id, up.stage, up.version, dict(up.tensors), up.meta)
        except CheckpointVersionError as exc:
            self._fail(msg, up.transfer_id, "stale_version", str(exc))
            return
        except CheckpointValueError as exc:
            self._fail(msg, up.transfer_id, "bad_request", str(exc))
            return
        except CheckpointTooLargeError as exc:
            self._fail(msg, up.transfer_id, "too_large", str(exc))
            return
        except OSError as exc:
            log.exception("cannot write %s/%s version %d", up.job_id, up.stage, up.version)
            self._fail(msg, up.transfer_id, "error", f"the store on {self.node} cannot write the checkpoint: {exc}")
            return
        self.metrics.count("checkpoints_saved")
        self.metrics.count("checkpoint_bytes_saved", info.nbytes)
        self._answer(msg, CheckpointSaved(
            transfer_id=up.transfer_id, job_id=info.job_id, stage=info.stage, version=info.version,
            count=len(info.tensors), nbytes=info.nbytes, file_bytes=info.file_bytes, sha256=info.sha256,
            created_at=info.created_at, versions=self.store.versions(info.job_id, info.stage)))

    def _load(self, msg: Inbound, req: CheckpointLoad) -> None:
        expires_at = msg.envelope.expires_at
        if expires_at is not None and time.time() > expires_at:
            self.metrics.count("expired")
            log.warning("dropping checkpoint load %s from %s: it expired while queued", req.transfer_id, msg.sender)
            return
        try:
            info, arrays = self.store.get(req.job_id, req.stage, req.version)
        except CheckpointNotFoundError as exc:
            self.metrics.count("checkpoints_missing")
            log.info("checkpoint load from %s: %s", msg.sender, exc)
            self._answer(msg, CheckpointMissing(transfer_id=req.transfer_id, job_id=req.job_id, stage=req.stage,
                                                version=req.version,
                                                versions=self.store.versions(req.job_id, req.stage),
                                                detail=str(exc)[:4096]))
            return
        except CheckpointCorruptError as exc:  # a file of the old format too: the detail says which
            log.error("%s", exc)
            self._fail(msg, req.transfer_id, "corrupt", str(exc))
            return
        except CheckpointTooLargeError as exc:
            self._fail(msg, req.transfer_id, "too_large", str(exc))
            return
        except OSError as exc:
            self._fail(msg, req.transfer_id, "error", f"the store on {self.node} cannot read the checkpoint: {exc}")
            return
        env = msg.envelope
        count = len(info.tensors)
        try:
            for index, entry in enumerate(info.tensors):
                self.bus.send_tensor(env.sender_node, env.sender_service, CheckpointTensor(
                    transfer_id=req.transfer_id, job_id=info.job_id, stage=info.stage, version=info.version,
                    name=entry.name, index=index, count=count), sendable(entry.dtype, arrays[entry.name]))
        except BusError as exc:
            self._fail(msg, req.transfer_id, "unreachable", (
                f"the store cannot send tensors to {env.sender_node}/{env.sender_service}: {exc}. A loader must be "
                "a service that advertises its status (its data-plane broker)"))
            return
        self.metrics.count("checkpoints_loaded")
        self.metrics.count("checkpoint_bytes_loaded", info.nbytes)
        log.info("sent %s/%s version %d (%d tensors, %d bytes) to %s", info.job_id, info.stage, info.version, count,
                 info.nbytes, msg.sender)
        self._answer(msg, CheckpointLoaded(
            transfer_id=req.transfer_id, job_id=info.job_id, stage=info.stage, version=info.version, count=count,
            nbytes=info.nbytes, file_bytes=info.file_bytes, sha256=info.sha256, created_at=info.created_at,
            meta=info.meta))

    # --- answers ------------------------------------------------------------------------------------

    def _fail(self, msg: Inbound, transfer_id: str | None, reason: CheckpointFailureReason, detail: str) -> None:
        self.metrics.count(f"checkpoint_failures.{reason}")
        log.warning("checkpoint request from %s failed (%s): %s", msg.sender, reason, detail)
        self._answer(msg, CheckpointFailed(transfer_id=transfer_id, reason=reason, detail=detail[:4096]))

    def _answer(self, msg: Inbound, answer: Message) -> None:
        try:
            self.bus.reply(msg, answer)
        except EdgeswarmError as exc:
            log.warning("could not answer %s: %s", msg.sender, exc)


def _warn_if_unwritable(directory: Path) -> None:
    """Log a warning now, rather than at the first save, when the checkpoint folder cannot be written."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        log.warning("the checkpoint folder %s is not writable by this process (%s is not); saves will fail. "
                    "Set EDGESWARM_CHECKPOINT_DIR to a writable folder", directory, existing)
