"""Messages of the transport benchmark (``edgeswarm bench transport``) and link measurements."""

from __future__ import annotations

from pydantic import Field

from edgeswarm.wire.schema import MIB, Message, schema


@schema("edgeswarm.bench.start", 1)
class BenchStart(Message):
    """Request: open a sink run that expects ``count`` tensors.

    The sink replies at once with an empty BenchAck, and again, to the same ``reply_to`` with
    ``done_correlation_id`` as the correlation id, when the last tensor has arrived.
    """

    run_id: str = Field(min_length=1, max_length=64)
    count: int = Field(ge=1)
    done_correlation_id: str = Field(min_length=1, max_length=64)


@schema("edgeswarm.bench.data", 1)
class BenchData(Message):
    """Carries one tensor of a sink run on the data plane; ``seq`` counts from 0."""

    run_id: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=0)


@schema("edgeswarm.bench.ack", 1)
class BenchAck(Message):
    """A sink run's progress. Times are the sink's Unix seconds; None until the first tensor arrives."""

    run_id: str
    received: int = Field(ge=0)
    bytes: int = Field(ge=0)
    first_at: float | None = None
    last_at: float | None = None


@schema("edgeswarm.bench.echo", 1)
class BenchEcho(Message):
    """Request: send ``payload`` straight back (round-trip measurement)."""

    MAX_BYTES = MIB + 64 * 1024

    payload: bytes = Field(max_length=1024 * 1024)


@schema("edgeswarm.bench.echo_reply", 1)
class BenchEchoReply(Message):
    """The echoed payload."""

    MAX_BYTES = MIB + 64 * 1024

    payload: bytes
