"""Encode and decode edgeswarm frames (docs/wire-format.md is the normative description).

Every MQTT payload on an ``edgeswarm/`` topic is one frame::

    offset 0   2 bytes  magic b"ES"
    offset 2   u8       frame version (1)
    offset 3   u8       flags (0; reserved)
    offset 4   u32 LE   H, the msgpack header's length in bytes
    offset 8   H bytes  msgpack map {"env": envelope, "body": map, "tensor": map or nil}
    offset 8+H ...      raw bytes: the tensor chunk described by "tensor", or nothing

A zero-length payload is not a frame: it is MQTT's way of clearing a retained topic.
"""

from __future__ import annotations

import struct
import time
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
from pydantic import ValidationError

from edgeswarm.errors import (
    ChecksumError,
    ExpiredMessageError,
    InvalidMessageError,
    MalformedFrameError,
    MessageTooLargeError,
    TensorHeaderError,
)
from edgeswarm.wire.schema import Envelope, Message, resolve
from edgeswarm.wire.tensor import TensorDescriptor, WireTensor, check_descriptor, storage_dtype

MAGIC = b"ES"
FRAME_VERSION = 1
PREFIX = struct.Struct("<2sBBI")
# The header holds control bodies too, so it may be as large as a control message; msgpack only
# allocates in proportion to bytes that actually arrived.
MAX_HEADER_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_TENSOR_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class Frame:
    """One decoded frame. ``raw`` views the payload's tensor bytes without copying them (and so keeps the whole
    payload, ``payload_bytes`` long, alive while it is held)."""

    envelope: Envelope
    body: Message
    tensor: TensorDescriptor | None
    raw: memoryview
    payload_bytes: int = 0

    def whole_tensor(self) -> WireTensor:
        """The tensor of a single-chunk frame as a zero-copy (read-only) view of the payload."""
        if self.tensor is None or self.tensor.n_chunks != 1:
            raise ValueError("whole_tensor() needs a frame that carries a complete, single-chunk tensor")
        arr = np.frombuffer(self.raw, dtype=storage_dtype(self.tensor.dtype)).reshape(self.tensor.shape)
        return WireTensor(self.tensor.dtype, arr)


def encode(envelope: Envelope, body: Message, tensor: TensorDescriptor | None = None, raw: Any = b"") -> bytes:
    """Build one frame. ``raw`` is any bytes-like object (copied once, into the frame). Raises MessageTooLargeError
    past the schema's size cap, InvalidMessageError for an integer outside msgpack's 64 bits."""
    try:
        header = msgpack.packb(
            {
                # The envelope and the descriptor hold only plain values (str, int, float, None, a tuple of ints),
                # so their field dicts are exactly what model_dump returns, at a tenth of its cost per frame.
                "env": dict(envelope.__dict__),
                "body": body.model_dump(),
                "tensor": None if tensor is None else dict(tensor.__dict__),
            },
            use_bin_type=True,
        )
    except OverflowError:
        raise InvalidMessageError(f"a {body.SCHEMA} message holds an integer outside -2**63 .. 2**64 - 1, which "
                                  "msgpack cannot carry: give that field a str type (decimal digits) instead") \
            from None
    if len(header) > min(MAX_HEADER_BYTES, body.MAX_BYTES):
        raise MessageTooLargeError(f"a {body.SCHEMA} message is {len(header)} bytes; its schema allows at most "
                                   f"{min(MAX_HEADER_BYTES, body.MAX_BYTES)}")
    return b"".join((PREFIX.pack(MAGIC, FRAME_VERSION, 0, len(header)), header, raw))


def peek_envelope(payload: bytes) -> dict[str, Any] | None:
    """Best-effort sender fields of a payload that failed to decode, for logging; None if unreadable."""
    try:
        header = _unpack_header(memoryview(payload))[0]
        env = header.get("env")
        return env if isinstance(env, dict) else None
    except Exception:
        return None


def decode(payload: bytes | bytearray | memoryview, *, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
           now: float | None = None) -> Frame:
    """Decode and validate one frame without copying its raw bytes.

    Checks, in order and before any allocation proportional to a declared size: prefix and header
    length, msgpack header, envelope, schema name and version, the header against the schema's size cap,
    body, expiry, tensor descriptor against the payload length and ``max_tensor_bytes``, and the chunk's
    CRC-32. Raises a WireError subclass.
    """
    view = memoryview(payload)
    header, raw = _unpack_header(view)
    try:
        envelope = Envelope.model_validate(header.get("env"))
    except ValidationError as exc:
        raise InvalidMessageError(f"invalid envelope: {_summarise(exc)}") from None
    cls = resolve(envelope.schema_name, envelope.schema_version)
    header_bytes = len(view) - len(raw) - PREFIX.size
    if header_bytes > cls.MAX_BYTES:
        raise MessageTooLargeError(f"a {envelope.schema_name} message of {header_bytes} bytes is over its schema's "
                                   f"cap of {cls.MAX_BYTES}")
    try:
        body = cls.model_validate(header.get("body"))
    except ValidationError as exc:
        raise InvalidMessageError(
            f"invalid {envelope.schema_name} v{envelope.schema_version} body: {_summarise(exc)}"
        ) from None
    if envelope.expires_at is not None and (now if now is not None else time.time()) > envelope.expires_at:
        raise ExpiredMessageError(f"{envelope.schema_name} message {envelope.msg_id} expired")
    tensor = None
    if header.get("tensor") is not None:
        try:
            tensor = TensorDescriptor.model_validate(header["tensor"])
        except ValidationError as exc:
            raise TensorHeaderError(f"invalid tensor descriptor: {_summarise(exc)}") from None
        check_descriptor(tensor, len(raw), max_tensor_bytes)
        if zlib.crc32(raw) != tensor.crc32:
            raise ChecksumError(
                f"chunk {tensor.chunk}/{tensor.n_chunks} of message {envelope.msg_id} fails its CRC-32"
            )
    elif len(raw):
        raise MalformedFrameError(f"{len(raw)} trailing bytes after a header that declares no tensor")
    return Frame(envelope, body, tensor, raw, len(view))


def _unpack_header(view: memoryview) -> tuple[dict[str, Any], memoryview]:
    if len(view) < PREFIX.size:
        raise MalformedFrameError(f"payload of {len(view)} bytes is shorter than the {PREFIX.size}-byte prefix")
    magic, version, _flags, hlen = PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise MalformedFrameError(f"bad magic {bytes(magic)!r}; not an edgeswarm frame")
    if version != FRAME_VERSION:
        raise MalformedFrameError(f"frame version {version} is not supported (this build reads {FRAME_VERSION})")
    if hlen > MAX_HEADER_BYTES or PREFIX.size + hlen > len(view):
        raise MalformedFrameError(f"header length {hlen} does not fit a {len(view)}-byte payload")
    try:
        header = msgpack.unpackb(view[PREFIX.size : PREFIX.size + hlen], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for corrupt input
        raise MalformedFrameError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise MalformedFrameError(f"header is a msgpack {type(header).__name__}, not a map")
    return header, view[PREFIX.size + hlen :]


def _summarise(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")
