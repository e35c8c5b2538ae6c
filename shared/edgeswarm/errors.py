"""Exceptions raised by edgeswarm.

Every error says what went wrong and, where there is one, what the user can do about it. Wire errors
carry a short machine-readable ``reason`` so that services can count rejections per cause in metrics.
"""

from __future__ import annotations


class EdgeswarmError(Exception):
    """Base class of every error edgeswarm raises on purpose."""


class ConfigError(EdgeswarmError):
    """A setting, cluster file or command-line argument is invalid."""


class MissingExtraError(ConfigError):
    """A feature needs an optional part of the package (an extra) that is not installed; the message gives the
    ``pip install 'edgeswarm[...]'`` that adds it."""


# --- wire format ------------------------------------------------------------------------------------


class WireError(EdgeswarmError):
    """A payload from the network could not be decoded; it was rejected before any large allocation."""

    reason: str = "malformed"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class MalformedFrameError(WireError):
    """The frame prefix, header length or msgpack header is corrupt."""

    reason = "malformed"


class MessageTooLargeError(WireError):
    """A message is larger than its schema's size cap (``Message.MAX_BYTES``)."""

    reason = "too_large"


class UnknownSchemaError(WireError):
    """The header names a schema this build does not know."""

    reason = "unknown_schema"


class UnsupportedSchemaVersionError(WireError):
    """The schema is known but the version is not one this build understands."""

    reason = "unsupported_version"


class InvalidMessageError(WireError):
    """The envelope or body does not validate against its schema."""

    reason = "invalid_message"


class TensorHeaderError(WireError):
    """A tensor descriptor lies: dtype, shape, sizes or chunk fields do not match the bytes."""

    reason = "bad_tensor_header"


class UnsupportedDtypeError(TensorHeaderError):
    """The dtype is not on the wire format's list."""

    reason = "unsupported_dtype"


class TensorTooLargeError(TensorHeaderError):
    """The declared tensor is larger than the configured limit."""

    reason = "tensor_too_large"


class ChecksumError(WireError):
    """A chunk's CRC-32 does not match its bytes."""

    reason = "checksum"


class ExpiredMessageError(WireError):
    """The message's expiry time has passed."""

    reason = "expired"


class ReassemblyError(WireError):
    """A chunked transfer cannot be reassembled (memory limit reached, inconsistent chunks)."""

    reason = "reassembly"


# --- bus ---------------------------------------------------------------------------------------------


class BusError(EdgeswarmError):
    """A problem talking to a broker."""


class BrokerUnavailableError(BusError):
    """The broker could not be reached or refused the connection."""


class PayloadTooLargeError(BusError):
    """A message is larger than the broker's maximum packet size; it was refused before sending."""


class InvalidTopicError(BusError):
    """A topic no broker accepts in a PUBLISH (empty, a wildcard, a control character); nothing was sent."""


class PublishTimeoutError(BusError):
    """A publish could not be handed to the broker in time (backpressure or a lost connection)."""


class RequestTimeoutError(BusError):
    """No reply arrived for a request in time."""


class RequestRejectedError(BusError):
    """The receiving service's bus refused a request (inbox full, invalid, not allowed) and said so."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class NotAuthorizedError(BusError):
    """The broker refused to let this client publish or subscribe (its ACL), or to connect (credentials)."""


class UnknownNodeError(BusError):
    """A message was addressed to a node that has never advertised a status."""


class PeerOfflineError(BusError):
    """A message was addressed to a node whose status says it is offline."""


class UnknownRouteError(WireError):
    """A message names a job, stream or node this service does not serve."""

    reason = "unknown_route"


# --- runtime -----------------------------------------------------------------------------------------


class DuplicateNodeError(EdgeswarmError):
    """Another live instance already holds this node id and service."""


# --- planning ----------------------------------------------------------------------------------------


class PlanningError(EdgeswarmError):
    """A plan could not be made from the inputs given."""


class ProfileError(PlanningError):
    """The profiles do not cover what the plan needs (a batch size, a device, a link, the same model)."""


class InfeasiblePlanError(PlanningError):
    """No configuration fits: the model does not fit the devices' memory, or there are no devices."""


class PlanTooLargeError(PlanningError):
    """Planning the request would take more work than the planner's time budget allows; the message gives the
    estimate, the budget and what to change (fix the number of micro-batches, fewer units or devices)."""


class PlanningDeadlineError(PlanTooLargeError):
    """A search ran past its deadline and was stopped between iterations (the work estimate was too low for
    this host, or the budget too tight)."""


class ScheduleError(PlanningError, ValueError):
    """A pipeline schedule cannot be built or simulated: malformed step times, bad warm-ups, or a deadlock."""


# --- profiling ---------------------------------------------------------------------------------------


class ProfilerError(EdgeswarmError):
    """A model, device or link could not be profiled."""


class ProfileRequestError(ProfilerError, ConfigError):
    """A profiling request is invalid: an unknown model, a bad model config or bad batch sizes."""


class LinkMeasurementError(ProfilerError):
    """A link to a peer could not be measured (the peer's profiler is unreachable or did not answer)."""


class ProfileTimeoutError(ProfilerError):
    """A node's profiler did not answer a profiling request in time."""


# --- models and profiling ----------------------------------------------------------------------------


class ModelError(EdgeswarmError):
    """A model cannot be traced, linearised or split as asked."""


class ModelTraceError(ModelError):
    """torch.fx cannot trace the model, or its graph has no single-tensor layer sequence (several inputs or
    outputs, an output that does not depend on the input, or a cut crossed by more than one tensor)."""


class StageRangeError(ModelError):
    """A stage range [start, end) is empty or lies outside the layer sequence."""


class BatchSizeError(ProfileRequestError):
    """A batch size, or a grid of batch sizes, is missing or invalid (batch sizes are integers >= 1)."""


class UnitProfilingError(ProfilerError):
    """A unit of a model's layer sequence failed to run while being profiled, or measured inconsistently."""


# --- training data -----------------------------------------------------------------------------------


class DataError(ConfigError):
    """A data set cannot be opened or read as asked: a file is missing, malformed or unsafe (a pickle that
    names code it has no need for is refused unread), or sample ids lie outside the split."""


# --- checkpoints -------------------------------------------------------------------------------------


class CheckpointError(EdgeswarmError):
    """A checkpoint could not be stored, found, read or transferred."""


class CheckpointValueError(CheckpointError, ValueError):
    """A job id, stage, version, tensor name, tensor dtype or meta value cannot be stored as given."""


class CheckpointVersionError(CheckpointValueError):
    """A version is older than every version the store keeps, so it would be deleted as soon as written."""


class CheckpointNotFoundError(CheckpointError):
    """The store has no such job, stage or version."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file fails its checksum or is malformed; the message names the file and the digests."""


class CheckpointFormatError(CheckpointCorruptError):
    """A checkpoint file is in a format this build does not read (the pre-safetensors ``.ckpt`` format, say)."""


class CheckpointTooLargeError(CheckpointError):
    """A checkpoint is larger than the store accepts (EDGESWARM_CHECKPOINT_MAX_BYTES)."""


class CheckpointForbiddenError(CheckpointError):
    """The store refused to let this node write that checkpoint: it is not the job's coordinator, nor a device of
    that stage in the job's current plan."""


class CheckpointTransferError(CheckpointError):
    """A checkpoint could not be sent to or received from a checkpoint store (unreachable, busy, incomplete)."""


class CheckpointTimeoutError(CheckpointTransferError):
    """A checkpoint store did not answer, or did not deliver every tensor, in time."""


# --- jobs -----------------------------------------------------------------------------------------------


class JobError(EdgeswarmError):
    """A job's step failed: a worker refused, failed or did not answer, or the planner had no plan; the message
    names it."""


class JobCancelled(JobError):
    """The job was cancelled."""


class MemoryBudgetError(JobError):
    """A worker's stage needs more memory than its device's budget; the message gives both."""
