"""What a checkpoint is, as the store, the messages and the client see it; and the checks on its names.

A checkpoint is one *version* (an integer, usually the training round) of the state of one *stage* of one
*job*: an ordered set of named tensors (model weights, optimizer state) plus a small *meta* map of
scalars (round, epoch, plan epoch, ...). Tensors use the wire format's dtypes
(``edgeswarm.wire.tensor.DTYPES``); bfloat16 is kept as its uint16 bit patterns, like on the wire.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from edgeswarm.errors import CheckpointValueError, UnsupportedDtypeError
from edgeswarm.wire.tensor import DTYPES, MAX_NDIM, WireTensor, storage_dtype, to_wire_array

if TYPE_CHECKING:
    import torch

# Job ids and stage names become folder names: node-id characters, and no leading dot (no ".", "..",
# nor hidden names, which the store keeps for its temporary files).
SAFE_NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$"
_SAFE_NAME = re.compile(SAFE_NAME_PATTERN)
SafeName = Annotated[str, Field(pattern=SAFE_NAME_PATTERN)]

MAX_VERSION = 9_999_999_999  # versions are written with 10 digits in file names
MAX_TENSORS = 100_000
MAX_TENSOR_NAME = 512
MAX_META_ENTRIES = 256
MAX_META_KEY = 128
MAX_META_STR = 4096

MetaValue = str | int | float | bool
"""A meta value: a JSON/msgpack scalar (no nil, no nesting)."""


def check_name(value: object, what: str = "job id") -> str:
    """``value`` if it is a safe job id or stage name, else CheckpointValueError saying what is allowed."""
    if not isinstance(value, str) or not _SAFE_NAME.fullmatch(value):
        raise CheckpointValueError(
            f"{what} {value!r} is not a safe file name: use 1 to 64 letters, digits, '_', '.' or '-', "
            "not starting with '.'")
    return value


def stage_name(stage: str | int) -> str:
    """A stage given as a name or an index, as the stage name the store uses (``3`` -> ``"3"``)."""
    if isinstance(stage, bool) or not isinstance(stage, str | int):
        raise CheckpointValueError(f"stage {stage!r} must be a name or an integer index")
    return check_name(str(stage), "stage")


def check_version(version: object) -> int:
    """``version`` if it is an integer in [0, MAX_VERSION], else CheckpointValueError."""
    if isinstance(version, bool) or not isinstance(version, int | np.integer) or not 0 <= version <= MAX_VERSION:
        raise CheckpointValueError(f"version {version!r} must be an integer from 0 to {MAX_VERSION}")
    return int(version)


def check_tensor_name(name: object) -> str:
    """``name`` if it is a usable tensor name (1 to 512 characters, no control characters)."""
    if (not isinstance(name, str) or not 1 <= len(name) <= MAX_TENSOR_NAME
            or any(ord(c) < 32 or ord(c) == 127 for c in name)):
        raise CheckpointValueError(f"tensor name {name!r:.80} must be 1 to {MAX_TENSOR_NAME} characters "
                                   "without control characters")
    return name


def check_meta(meta: Mapping[str, Any] | None) -> dict[str, MetaValue]:
    """A copy of ``meta`` if every key is a short string and every value a scalar, else CheckpointValueError."""
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise CheckpointValueError(f"meta must be a mapping of names to scalars, not {type(meta).__name__}")
    if len(meta) > MAX_META_ENTRIES:
        raise CheckpointValueError(f"meta has {len(meta)} entries; at most {MAX_META_ENTRIES} are kept")
    out: dict[str, MetaValue] = {}
    for key, value in meta.items():
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_META_KEY:
            raise CheckpointValueError(f"meta key {key!r:.80} must be a string of 1 to {MAX_META_KEY} characters")
        if isinstance(value, np.generic):
            value = value.item()
        if not isinstance(value, str | int | float | bool):
            raise CheckpointValueError(f"meta[{key!r}] is a {type(value).__name__}; only str, int, float and "
                                       "bool values are kept")
        if isinstance(value, str) and len(value) > MAX_META_STR:
            raise CheckpointValueError(f"meta[{key!r}] is {len(value)} characters; at most {MAX_META_STR}")
        out[key] = value
    return out


Meta = Annotated[dict[str, MetaValue], AfterValidator(check_meta)]
"""A validated meta map (pydantic field type)."""


class TensorEntry(BaseModel):
    """One tensor of a checkpoint: its name, wire dtype name, shape and size in bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=MAX_TENSOR_NAME)
    dtype: str
    shape: tuple[Annotated[int, Field(ge=0)], ...] = Field(max_length=MAX_NDIM)
    nbytes: int = Field(ge=0)

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPES:
            raise ValueError(f"dtype {value!r} is not one of {sorted(DTYPES)}")
        return value


class CheckpointInfo(BaseModel):
    """One stored checkpoint version, without its tensor data.

    ``tensors`` are in the order they were saved; ``nbytes`` is the sum of their sizes; ``file_bytes``
    the size of the file that holds them; ``sha256`` the hex SHA-256 recorded at the end of that file
    (over every byte before it); ``created_at`` the Unix time (seconds) the version was written.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: SafeName
    stage: SafeName
    version: int = Field(ge=0, le=MAX_VERSION)
    created_at: float
    meta: Meta = Field(default_factory=dict)
    tensors: tuple[TensorEntry, ...] = ()
    nbytes: int = Field(ge=0)
    file_bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]


TensorLike = Any
"""What a checkpoint's tensors may be given as: a numpy array (an ``ml_dtypes.bfloat16`` one too), a torch
tensor (any device; bfloat16 included), or a WireTensor (a wire dtype name and its storage array, e.g. the
uint16 bits of a bfloat16 tensor returned by a load)."""


def as_wire(value: TensorLike, name: str = "tensor") -> tuple[str, np.ndarray]:
    """``value`` as (wire dtype name, C-contiguous little-endian storage array), copying only if needed.

    Raises CheckpointValueError for a dtype the wire format has no name for (float64, int8, ...) or for a
    value that is no tensor.
    """
    try:
        if isinstance(value, WireTensor):
            storage = storage_dtype(value.dtype)
            arr = np.asarray(value.array)
            if arr.dtype.kind != storage.kind or arr.dtype.itemsize != storage.itemsize:
                raise CheckpointValueError(f"tensor {name!r}: a {value.dtype} WireTensor must hold {storage} "
                                           f"storage, not {arr.dtype}")
            arr = arr.astype(storage, copy=False)
            return value.dtype, arr if arr.flags.c_contiguous else arr.copy(order="C")
        return to_wire_array(value)
    except UnsupportedDtypeError as exc:
        raise CheckpointValueError(f"tensor {name!r}: {exc}; convert it (e.g. to float32) before saving") from None
    except TypeError as exc:
        raise CheckpointValueError(f"tensor {name!r}: {exc}") from None


def sendable(dtype: str, storage: np.ndarray) -> Any:
    """A value ``Bus.send_tensor`` sends as ``dtype``: the array itself, or a torch view for bfloat16 bits."""
    if dtype != "bfloat16":
        return storage
    import torch

    return torch.from_numpy(np.ascontiguousarray(storage).view(np.int16)).view(torch.bfloat16)


def as_torch(info: CheckpointInfo, arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The tensors of a loaded checkpoint as torch tensors with their real dtypes (bfloat16 restored).

    Shares memory with ``arrays`` where they are writable; read-only ones are copied once.
    """
    return {entry.name: WireTensor(entry.dtype, arrays[entry.name]).to_torch() for entry in info.tensors}
