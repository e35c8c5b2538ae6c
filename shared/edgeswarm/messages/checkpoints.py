"""Messages of the checkpoint store: uploads tensor by tensor, commits, loads and listings.

**Save.** The writer sends each tensor as a CheckpointTensor on the store's data topic
(``edgeswarm/node/{store}/checkpoint-store/data``, chunked by the bus), all tagged with one
``transfer_id`` of its choosing and ``index``/``count``; then it sends a CheckpointCommit request on the
store's request topic. The tensors and the commit may arrive in any order (they travel through different
brokers). Once the commit and all ``count`` tensors are in, the store writes the version atomically and
answers the commit with CheckpointSaved, or CheckpointFailed (too large, incomplete after the upload
timeout, busy, a stale version, a disk error).

**Load.** The reader sends a CheckpointLoad request naming a ``transfer_id``; the store streams each
tensor of the version as a CheckpointTensor to the reader's own data topic
(``edgeswarm/node/{reader node}/{reader service}/data``, on the broker the reader's status advertises),
then answers with CheckpointLoaded; or it answers CheckpointMissing or CheckpointFailed (a corrupt file).

**List.** CheckpointList asks which versions exist; CheckpointListing answers.
Sizes are bytes; times Unix seconds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeswarm.values.checkpoints import (
    MAX_TENSOR_NAME,
    MAX_TENSORS,
    MAX_VERSION,
    Meta,
    SafeName,
)
from edgeswarm.wire.schema import MIB, Message, schema

TransferId = str
MAX_LISTING = 4096


@schema("edgeswarm.checkpoint.tensor", 1)
class CheckpointTensor(Message):
    """One named tensor of a checkpoint being saved or loaded; always carries the tensor.

    ``transfer_id`` ties the tensors of one upload (chosen by the writer) or one load (chosen by the
    reader) together; ``index`` runs from 0 to ``count`` - 1 in save order.
    """

    transfer_id: TransferId = Field(min_length=1, max_length=64)
    job_id: SafeName
    stage: SafeName
    version: int = Field(ge=0, le=MAX_VERSION)
    name: str = Field(min_length=1, max_length=MAX_TENSOR_NAME)
    index: int = Field(ge=0)
    count: int = Field(ge=1, le=MAX_TENSORS)

    @model_validator(mode="after")
    def _index_in_range(self) -> CheckpointTensor:
        if self.index >= self.count:
            raise ValueError(f"index {self.index} is not below count {self.count}")
        return self


@schema("edgeswarm.checkpoint.commit", 1)
class CheckpointCommit(Message):
    """Request: store the ``count`` tensors of upload ``transfer_id`` (``nbytes`` in all) as ``version``.

    Answered with CheckpointSaved or CheckpointFailed once every tensor has arrived or the upload has
    timed out. ``count`` may be 0 (a checkpoint of ``meta`` alone).
    """

    MAX_BYTES = 2 * MIB

    transfer_id: TransferId = Field(min_length=1, max_length=64)
    job_id: SafeName
    stage: SafeName
    version: int = Field(ge=0, le=MAX_VERSION)
    count: int = Field(ge=0, le=MAX_TENSORS)
    nbytes: int = Field(ge=0)
    meta: Meta = Field(default_factory=dict)


@schema("edgeswarm.checkpoint.saved", 1)
class CheckpointSaved(Message):
    """The answer to a commit: the version is on disk. ``sha256`` is the file's digest, ``versions`` the
    versions of (job, stage) kept after pruning."""

    transfer_id: TransferId
    job_id: SafeName
    stage: SafeName
    version: int = Field(ge=0)
    count: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    file_bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    created_at: float
    versions: list[int] = Field(default_factory=list)


@schema("edgeswarm.checkpoint.load", 1)
class CheckpointLoad(Message):
    """Request: stream ``version`` (None: the latest) of (job, stage) to the sender's data topic, tagged
    ``transfer_id``."""

    transfer_id: TransferId = Field(min_length=1, max_length=64)
    job_id: SafeName
    stage: SafeName
    version: int | None = Field(default=None, ge=0, le=MAX_VERSION)


@schema("edgeswarm.checkpoint.loaded", 1)
class CheckpointLoaded(Message):
    """The answer to a load once its ``count`` tensors have been sent: which version they are, with its
    meta, total tensor bytes, file size and digest (verified before sending)."""

    MAX_BYTES = 2 * MIB

    transfer_id: TransferId
    job_id: SafeName
    stage: SafeName
    version: int = Field(ge=0)
    count: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    file_bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    created_at: float
    meta: Meta = Field(default_factory=dict)


@schema("edgeswarm.checkpoint.missing", 1)
class CheckpointMissing(Message):
    """The answer to a load of a job, stage or version the store does not have. ``versions`` are the
    versions it has of (job, stage), possibly none."""

    transfer_id: TransferId
    job_id: SafeName
    stage: SafeName
    version: int | None = None
    versions: list[int] = Field(default_factory=list)
    detail: str = Field(max_length=4096)


CheckpointFailureReason = Literal["corrupt", "too_large", "stale_version", "incomplete", "busy", "unreachable",
                                  "bad_request", "forbidden", "error"]


@schema("edgeswarm.checkpoint.failed", 1)
class CheckpointFailed(Message):
    """The answer to a commit, load or list the store could not serve, with a human-readable ``detail``.

    ``reason``: ``corrupt`` (the file fails its checksum), ``too_large`` (over
    EDGESWARM_CHECKPOINT_MAX_BYTES), ``stale_version`` (older than every kept version), ``incomplete``
    (tensors missing when the upload timed out), ``busy`` (too many uploads or requests at once),
    ``unreachable`` (the store cannot send to the reader's data topic), ``bad_request`` (inconsistent
    upload), ``forbidden`` (the sender is neither the job's coordinator nor a device of that stage in the job's
    current plan) or ``error`` (anything else, e.g. a disk error).
    """

    transfer_id: TransferId | None = None
    reason: CheckpointFailureReason
    detail: str = Field(max_length=4096)


@schema("edgeswarm.checkpoint.list", 1)
class CheckpointList(Message):
    """Request: the stored versions of one job (``job_id``) or of every job (None)."""

    job_id: SafeName | None = None


class StageVersions(BaseModel):
    """The versions stored for one (job, stage), ascending."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: SafeName
    stage: SafeName
    versions: list[int]


@schema("edgeswarm.checkpoint.listing", 1)
class CheckpointListing(Message):
    """The answer to a list: one entry per (job, stage) that has versions."""

    MAX_BYTES = 4 * MIB

    entries: list[StageVersions] = Field(default_factory=list, max_length=MAX_LISTING)
