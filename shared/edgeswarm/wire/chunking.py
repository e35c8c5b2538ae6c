"""Cutting tensors into chunk frames and putting them back together.

A tensor larger than the chunk size travels as several frames that share the envelope's ``msg_id``.
The receiver copies each chunk into one buffer (the only copy on the receive path), allocated once half
the tensor has arrived so that a header alone reserves nothing; it tolerates chunks out of order and
duplicated (QoS 1 redelivery), bounds what each sender may hold, and frees transfers that stay incomplete
past a timeout.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgeswarm.errors import ReassemblyError
from edgeswarm.wire.codec import Frame, encode
from edgeswarm.wire.schema import Envelope, Message
from edgeswarm.wire.tensor import (
    Arrival,
    TensorDescriptor,
    WireTensor,
    expected_chunks,
    raw_bytes,
    storage_dtype,
    to_wire_array,
)

DEFAULT_CHUNK_BYTES = 1024 * 1024


def tensor_frames(envelope: Envelope, body: Message, value: Any,
                  chunk_size: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """Frames carrying ``value`` (numpy array or torch tensor) in chunks of at most ``chunk_size`` bytes.

    A generator, so a sender holds one chunk frame at a time; each frame copies its slice once.
    """
    if chunk_size < 1:
        raise ValueError("chunk_size must be at least 1 byte")
    dtype, storage = to_wire_array(value)
    data = raw_bytes(storage)
    n_chunks = expected_chunks(len(data), chunk_size)
    for index in range(n_chunks):
        piece = data[index * chunk_size : (index + 1) * chunk_size]
        desc = TensorDescriptor(
            dtype=dtype,
            shape=tuple(storage.shape),
            nbytes=len(data),
            chunk_size=chunk_size,
            chunk=index,
            n_chunks=n_chunks,
            crc32=zlib.crc32(piece),
        )
        yield encode(envelope, body, desc, piece)


# What one chunk held before its transfer's buffer exists costs beyond its payload (dict entry, view, set entry).
_PIECE_OVERHEAD = 256


@dataclass
class _Partial:
    desc: TensorDescriptor
    sender: str  # the sender node: whose budget the transfer counts against
    deadline: float
    first_at: float  # when its first chunk arrived (the reassembler's clock)
    first_bytes: int  # that chunk's payload
    received: set[int] = field(default_factory=set)
    # Until half the tensor has arrived its chunks are kept as they came (views of their payloads); only then is
    # the whole buffer allocated, so a header can never reserve more than twice the bytes actually sent.
    pieces: dict[int, memoryview] = field(default_factory=dict)
    piece_bytes: int = 0
    buffer: np.ndarray | None = None
    held: int = 0  # bytes charged to the limits: the pieces' payloads, or nbytes once the buffer exists


class Reassembler:
    """Collects chunk frames into whole tensors. Thread-safe.

    Memory is charged for what arrived, not for what a header claims: a transfer holds its chunks as received
    until half its bytes are in, and only then allocates its whole buffer (the one copy of the receive path).
    ``max_pending_bytes`` bounds what all incomplete transfers hold together, ``max_sender_bytes`` what those of
    one sender node hold, and ``max_sender_transfers`` how many one sender may have open; ``timeout_s`` is how
    long an incomplete transfer may wait for its next chunk before it is freed.
    """

    def __init__(self, *, max_pending_bytes: int = 4 << 30, timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, remember: int = 4096,
                 max_sender_bytes: int | None = None, max_sender_transfers: int = 256) -> None:
        self._max_pending = max_pending_bytes
        self._max_sender = max_pending_bytes if max_sender_bytes is None else max_sender_bytes
        self._max_sender_transfers = max_sender_transfers
        self._timeout = timeout_s
        self._clock = clock
        self._remember = remember
        self._lock = threading.Lock()
        self._partial: dict[tuple[str, str], _Partial] = {}
        self._senders: dict[str, tuple[int, int]] = {}  # sender node -> (bytes held, open transfers)
        self._done: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.pending_bytes = 0
        self.duplicate_chunks = 0
        self.expired_transfers = 0

    def add(self, frame: Frame) -> WireTensor | None:
        """Feed one validated chunk frame; returns the whole tensor when this chunk completes it.

        Returns None for a chunk that leaves the transfer incomplete or that was seen before. Raises
        ReassemblyError (and drops the transfer) if the chunk disagrees with earlier chunks or a memory or
        transfer limit would be exceeded.
        """
        desc = frame.tensor
        if desc is None:
            raise ValueError("add() needs a frame that carries a tensor chunk")
        key = (frame.envelope.sender_instance, frame.envelope.msg_id)
        now = self._clock()
        with self._lock:
            self._sweep_locked(now)
            if key in self._done:
                self.duplicate_chunks += 1
                return None
            if desc.n_chunks == 1:
                self._mark_done(key)
                return frame.whole_tensor()
            part = self._partial.get(key)
            if part is None:
                part = self._open(key, frame.envelope.sender_node, desc, now, len(frame.raw))
            elif _shape_of(part.desc) != _shape_of(desc):
                self._drop(key)
                raise ReassemblyError(
                    f"chunk {desc.chunk} of message {key[1]} disagrees with earlier chunks "
                    f"({_shape_of(desc)} vs {_shape_of(part.desc)}); transfer dropped"
                )
            if desc.chunk in part.received:
                self.duplicate_chunks += 1
                return None
            if part.buffer is None:
                self._hold(key, part, desc.chunk, frame)
            else:
                start, length = desc.chunk_span()
                part.buffer[start : start + length] = np.frombuffer(frame.raw, dtype=np.uint8)
            part.received.add(desc.chunk)
            part.deadline = now + self._timeout
            if len(part.received) < desc.n_chunks:
                return None
            self._drop(key)
            self._mark_done(key)
        assert part.buffer is not None  # every byte arrived, so more than half did and the buffer exists
        arr = part.buffer.view(storage_dtype(desc.dtype)).reshape(desc.shape)
        return WireTensor(desc.dtype, arr, Arrival(desc.nbytes - part.first_bytes, desc.n_chunks - 1,
                                                   max(0.0, now - part.first_at)))

    def sweep(self) -> int:
        """Free transfers whose timeout has passed; returns how many were freed."""
        with self._lock:
            return self._sweep_locked(self._clock())

    @property
    def pending_transfers(self) -> int:
        with self._lock:
            return len(self._partial)

    def sender_bytes(self, sender: str) -> int:
        """Bytes the incomplete transfers of sender node ``sender`` hold."""
        with self._lock:
            return self._senders.get(sender, (0, 0))[0]

    # --- internals (lock held) ----------------------------------------------------------------------

    def _open(self, key: tuple[str, str], sender: str, desc: TensorDescriptor, now: float,
              first_bytes: int) -> _Partial:
        held, transfers = self._senders.get(sender, (0, 0))
        if transfers >= self._max_sender_transfers:
            raise ReassemblyError(f"{sender} already has {transfers} incomplete tensor transfers open, the most one "
                                  "sender may have; the new one is refused")
        part = _Partial(desc, sender, now + self._timeout, now, first_bytes)
        self._partial[key] = part
        self._senders[sender] = (held, transfers + 1)
        return part

    def _hold(self, key: tuple[str, str], part: _Partial, chunk: int, frame: Frame) -> None:
        """Keep one chunk of a transfer without a buffer; allocate the buffer once half the bytes are in."""
        raw = frame.raw
        cost = max(len(raw), frame.payload_bytes) + _PIECE_OVERHEAD
        allocate = 2 * (part.piece_bytes + len(raw)) >= part.desc.nbytes
        self._charge(key, part, (part.desc.nbytes if allocate else part.held + cost) - part.held)
        if not allocate:
            part.pieces[chunk] = raw
            part.piece_bytes += len(raw)
            return
        part.buffer = np.empty(part.desc.nbytes, dtype=np.uint8)
        part.pieces[chunk] = raw
        for index, piece in part.pieces.items():
            start = index * part.desc.chunk_size
            part.buffer[start : start + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
        part.pieces.clear()
        part.piece_bytes = 0

    def _charge(self, key: tuple[str, str], part: _Partial, delta: int) -> None:
        held, transfers = self._senders[part.sender]
        if self.pending_bytes + delta > self._max_pending or held + delta > self._max_sender:
            why = (f"reassembly memory limit reached: {self.pending_bytes} bytes pending ({held} from {part.sender}) "
                   f"+ {delta} more for a {part.desc.nbytes}-byte tensor > {self._max_pending} in all "
                   f"(EDGESWARM_MAX_REASSEMBLY_BYTES) or {self._max_sender} per sender "
                   "(EDGESWARM_MAX_REASSEMBLY_BYTES_PER_SENDER); transfer dropped")
            self._drop(key)
            raise ReassemblyError(why)
        part.held += delta
        self.pending_bytes += delta
        self._senders[part.sender] = (held + delta, transfers)

    def _sweep_locked(self, now: float) -> int:
        stale = [k for k, p in self._partial.items() if p.deadline < now]
        for key in stale:
            self._drop(key)
            self._mark_done(key)  # late chunks of a freed transfer must not start a new one
        self.expired_transfers += len(stale)
        return len(stale)

    def _drop(self, key: tuple[str, str]) -> None:
        part = self._partial.pop(key, None)
        if part is None:
            return
        self.pending_bytes -= part.held
        held, transfers = self._senders[part.sender]
        if transfers <= 1:
            del self._senders[part.sender]
        else:
            self._senders[part.sender] = (held - part.held, transfers - 1)

    def _mark_done(self, key: tuple[str, str]) -> None:
        self._done[key] = None
        while len(self._done) > self._remember:
            self._done.popitem(last=False)


def _shape_of(desc: TensorDescriptor) -> tuple[Any, ...]:
    return (desc.dtype, desc.shape, desc.nbytes, desc.chunk_size, desc.n_chunks)
