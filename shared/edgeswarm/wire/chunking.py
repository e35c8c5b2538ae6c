"""Cutting tensors into chunk frames and putting them back together.

A tensor larger than the chunk size travels as several frames that share the envelope's ``msg_id``.
The receiver copies each chunk into one preallocated buffer (the only copy on the receive path),
tolerates chunks out of order and duplicated (QoS 1 redelivery), and frees transfers that stay
incomplete past a timeout.
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
from edgeswarm.wire.tensor import TensorDescriptor, WireTensor, expected_chunks, raw_bytes, storage_dtype, to_wire_array

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


@dataclass
class _Partial:
    desc: TensorDescriptor
    buffer: np.ndarray
    deadline: float
    received: set[int] = field(default_factory=set)


class Reassembler:
    """Collects chunk frames into whole tensors. Thread-safe.

    ``max_pending_bytes`` bounds the memory held by incomplete transfers; ``timeout_s`` is how long an
    incomplete transfer may wait for its next chunk before it is freed.
    """

    def __init__(self, *, max_pending_bytes: int, timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 remember: int = 4096) -> None:
        self._max_pending = max_pending_bytes
        self._timeout = timeout_s
        self._clock = clock
        self._remember = remember
        self._lock = threading.Lock()
        self._partial: dict[tuple[str, str], _Partial] = {}
        self._done: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.pending_bytes = 0
        self.duplicate_chunks = 0
        self.expired_transfers = 0

    def add(self, frame: Frame) -> WireTensor | None:
        """Feed one validated chunk frame; returns the whole tensor when this chunk completes it.

        Returns None for a chunk that leaves the transfer incomplete or that was seen before. Raises
        ReassemblyError if the chunk disagrees with earlier chunks or the memory limit would be exceeded.
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
                if self.pending_bytes + desc.nbytes > self._max_pending:
                    raise ReassemblyError(
                        f"reassembly memory limit reached: {self.pending_bytes} bytes pending + "
                        f"{desc.nbytes} new > {self._max_pending} (EDGESWARM_MAX_REASSEMBLY_BYTES)"
                    )
                part = _Partial(desc, np.empty(desc.nbytes, dtype=np.uint8), now + self._timeout)
                self._partial[key] = part
                self.pending_bytes += desc.nbytes
            elif _shape_of(part.desc) != _shape_of(desc):
                self._drop(key)
                raise ReassemblyError(
                    f"chunk {desc.chunk} of message {key[1]} disagrees with earlier chunks "
                    f"({_shape_of(desc)} vs {_shape_of(part.desc)}); transfer dropped"
                )
            if desc.chunk in part.received:
                self.duplicate_chunks += 1
                return None
            start, length = desc.chunk_span()
            part.buffer[start : start + length] = np.frombuffer(frame.raw, dtype=np.uint8)
            part.received.add(desc.chunk)
            part.deadline = now + self._timeout
            if len(part.received) < desc.n_chunks:
                return None
            self._drop(key)
            self._mark_done(key)
        arr = part.buffer.view(storage_dtype(desc.dtype)).reshape(desc.shape)
        return WireTensor(desc.dtype, arr)

    def sweep(self) -> int:
        """Free transfers whose timeout has passed; returns how many were freed."""
        with self._lock:
            return self._sweep_locked(self._clock())

    @property
    def pending_transfers(self) -> int:
        with self._lock:
            return len(self._partial)

    def _sweep_locked(self, now: float) -> int:
        stale = [k for k, p in self._partial.items() if p.deadline < now]
        for key in stale:
            self._drop(key)
            self._mark_done(key)  # late chunks of a freed transfer must not start a new one
        self.expired_transfers += len(stale)
        return len(stale)

    def _drop(self, key: tuple[str, str]) -> None:
        part = self._partial.pop(key, None)
        if part is not None:
            self.pending_bytes -= part.desc.nbytes

    def _mark_done(self, key: tuple[str, str]) -> None:
        self._done[key] = None
        while len(self._done) > self._remember:
            self._done.popitem(last=False)


def _shape_of(desc: TensorDescriptor) -> tuple[Any, ...]:
    return (desc.dtype, desc.shape, desc.nbytes, desc.chunk_size, desc.n_chunks)
