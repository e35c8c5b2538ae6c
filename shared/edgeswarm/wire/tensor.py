"""Tensors on the wire: dtype table, descriptors, and numpy/torch conversion.

A tensor travels as its raw C-contiguous little-endian bytes plus a descriptor (dtype by name, shape,
total byte size, chunking, CRC-32 of the chunk). bfloat16 has no numpy dtype, so its storage array is
``uint16`` holding the bit patterns and the descriptor says ``bfloat16``. torch is imported lazily so
that services which never touch tensors do not pay for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.errors import TensorHeaderError, TensorTooLargeError, UnsupportedDtypeError

if TYPE_CHECKING:
    import torch

# Wire dtype name -> numpy storage dtype (always little-endian, the byte order on the wire).
DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}

MAX_NDIM = 32


class TensorDescriptor(BaseModel):
    """The ``tensor`` map of a frame header: which tensor the frame's raw bytes belong to.

    The raw bytes of chunk ``chunk`` are bytes ``[chunk * chunk_size, min(nbytes, (chunk + 1) * chunk_size))``
    of the tensor's C-order little-endian storage, and ``crc32`` is the zlib CRC-32 of exactly those bytes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: str
    shape: tuple[int, ...] = Field(max_length=MAX_NDIM)
    nbytes: int = Field(ge=0)
    chunk_size: int = Field(ge=1)
    chunk: int = Field(ge=0)
    n_chunks: int = Field(ge=1)
    crc32: int = Field(ge=0, lt=2**32)

    def chunk_span(self) -> tuple[int, int]:
        """Byte offset and length of this chunk inside the whole tensor."""
        start = self.chunk * self.chunk_size
        return start, max(0, min(self.nbytes, start + self.chunk_size) - start)


def storage_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype that stores wire dtype ``name``; raises UnsupportedDtypeError if not on the list."""
    try:
        return DTYPES[name]
    except KeyError:
        raise UnsupportedDtypeError(
            f"dtype {name!r} is not on the wire format's list {sorted(DTYPES)}"
        ) from None


def expected_chunks(nbytes: int, chunk_size: int) -> int:
    """Number of chunks a tensor of ``nbytes`` bytes is cut into at ``chunk_size`` bytes (at least one)."""
    return max(1, math.ceil(nbytes / chunk_size))


def check_descriptor(desc: TensorDescriptor, raw_len: int, max_tensor_bytes: int) -> None:
    """Check that a descriptor is self-consistent, within limits and matches ``raw_len`` payload bytes.

    Runs before any buffer is allocated or viewed for the tensor, so a lying header costs nothing but this
    check. The shape must be something numpy can view: non-negative dimensions whose product, with every zero
    dimension counted as one, stays within ``max_tensor_bytes`` (``[0, 2**62]`` holds no bytes but is no view).
    """
    item = storage_dtype(desc.dtype).itemsize
    if any(d < 0 for d in desc.shape):
        raise TensorHeaderError(f"tensor: negative dimension in shape {list(desc.shape)}")
    extent = item
    for d in desc.shape:
        extent *= max(d, 1)
        if extent > max_tensor_bytes:
            raise TensorTooLargeError(
                f"tensor: shape {list(desc.shape)[:MAX_NDIM]} of {desc.dtype} spans more than the limit of "
                f"{max_tensor_bytes} bytes (EDGESWARM_MAX_TENSOR_BYTES)")
    declared = math.prod(desc.shape) * item
    if declared != desc.nbytes:
        raise TensorHeaderError(
            f"tensor: shape {list(desc.shape)} of {desc.dtype} is {declared} bytes "
            f"but the header says nbytes={desc.nbytes}"
        )
    if desc.nbytes > max_tensor_bytes:
        raise TensorTooLargeError(
            f"tensor: {desc.nbytes} bytes exceeds the limit of {max_tensor_bytes} bytes "
            "(EDGESWARM_MAX_TENSOR_BYTES)"
        )
    if desc.n_chunks != expected_chunks(desc.nbytes, desc.chunk_size):
        raise TensorHeaderError(
            f"tensor: {desc.nbytes} bytes at chunk_size {desc.chunk_size} is "
            f"{expected_chunks(desc.nbytes, desc.chunk_size)} chunks, header says {desc.n_chunks}"
        )
    if desc.chunk >= desc.n_chunks:
        raise TensorHeaderError(f"tensor: chunk {desc.chunk} out of range 0..{desc.n_chunks - 1}")
    _, length = desc.chunk_span()
    if raw_len != length:
        raise TensorHeaderError(
            f"tensor: chunk {desc.chunk} should carry {length} bytes, the frame carries {raw_len}"
        )


@dataclass(frozen=True)
class Arrival:
    """How a tensor of several chunks arrived: ``chunks`` chunks of ``nbytes`` bytes in all came in ``seconds``
    after its first chunk (receiver's clock). The rate its path delivered it at, whatever the sender's clock says:
    a link's bandwidth and per-message cost are fitted from it."""

    nbytes: int
    chunks: int
    seconds: float


@dataclass(frozen=True)
class WireTensor:
    """A tensor decoded from the wire.

    ``array`` is the storage array with the tensor's shape: a zero-copy view of the received bytes
    (read-only when it views an immutable payload). For bfloat16 it holds the uint16 bit patterns.
    ``arrival`` says how its chunks after the first arrived (None for a tensor of one chunk).
    """

    dtype: str
    array: np.ndarray
    arrival: Arrival | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def to_torch(self) -> torch.Tensor:
        """The tensor as torch: zero-copy when the storage is writable, otherwise one copy."""
        import torch

        arr = self.array if self.array.flags.writeable else self.array.copy()
        if self.dtype == "bfloat16":
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)


def to_wire_array(value: Any) -> tuple[str, np.ndarray]:
    """Turn a numpy array or torch tensor into (wire dtype name, C-contiguous little-endian storage).

    Non-contiguous and big-endian inputs are copied once into wire order; contiguous little-endian
    inputs are not copied. Raises UnsupportedDtypeError for dtypes not on the list.
    """
    if isinstance(value, np.ndarray):
        return _numpy_to_wire(value)
    if type(value).__module__.startswith("torch"):
        return _torch_to_wire(value)
    raise TypeError(f"expected a numpy array or torch tensor, got {type(value).__name__}")


# numpy dtype -> its name: ``dtype.name`` is computed in Python on every access (about 3 us, a tenth of what
# sending a 1 KB tensor costs), and a sender sees the same few dtypes over and over.
_DTYPE_NAMES: dict[np.dtype[Any], str] = {}


def _dtype_name(dtype: np.dtype[Any]) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = dtype.name
        if len(_DTYPE_NAMES) < 256:  # bounded: structured dtypes are many, and each would be refused anyway
            _DTYPE_NAMES[dtype] = name
    return name


def _numpy_to_wire(arr: np.ndarray) -> tuple[str, np.ndarray]:
    name = _dtype_name(arr.dtype)
    if name == "bfloat16":  # ml_dtypes.bfloat16: travels as its uint16 bits
        arr = arr.view(np.uint16)
    storage = storage_dtype(name)
    if arr.dtype != storage:
        arr = arr.astype(storage)  # the name matched, so only the byte order differs: swap to little-endian
    # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
    return name, arr if arr.flags.c_contiguous else arr.copy(order="C")


def _torch_to_wire(tensor: torch.Tensor) -> tuple[str, np.ndarray]:
    import torch

    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return "bfloat16", t.view(torch.int16).numpy().view(np.uint16)
    name = str(t.dtype).removeprefix("torch.")
    storage_dtype(name)
    return name, t.numpy()


def raw_bytes(storage: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous storage array (no copy)."""
    return memoryview(storage.reshape(-1).view(np.uint8))
