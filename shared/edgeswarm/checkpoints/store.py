"""Checkpoints on disk: versioned tensor sets per (job, stage), written atomically, checked on every read.

Layout under the store's directory (``EDGESWARM_CHECKPOINT_DIR``)::

    {job_id}/{stage}/v{version:010d}.ckpt      one file per version
    {job_id}/{stage}/.v{version:010d}.ckpt.*.tmp   a write in progress (or left by a crash; never read)

Only the ``keep`` highest versions of each (job, stage) are kept; older ones are deleted after each
write. A write goes to a temporary file in the same folder, which is flushed and fsynced, renamed over
the final name (``os.replace``, atomic on POSIX) and then the folder is fsynced: a reader sees the old
version or the new one, never part of one, and a crash at any point leaves every earlier version intact.

**File format, version 1.** All integers little-endian; no pickle anywhere.

=========  ==========  ==================================================================================
offset     size        field
=========  ==========  ==================================================================================
0          6           magic: the ASCII bytes ``ESCKPT``
6          2           format version: unsigned 16-bit, ``1``
8          4           ``H``: length of the header in bytes, unsigned 32-bit
12         ``H``       header: a UTF-8 JSON object (below)
12 + H     ...         zero bytes up to ``P``, the first multiple of 64 at or after ``12 + H``
``P``      ...         the payload: each tensor's bytes at ``P + offset`` (offsets are multiples of 64;
                       zero bytes between tensors)
end - 32   32          SHA-256 of every byte of the file before it
=========  ==========  ==================================================================================

The header object has exactly these keys: ``format`` (1), ``job_id``, ``stage`` (strings), ``version``
(integer), ``created_at`` (Unix seconds), ``meta`` (object of string -> string, number or boolean),
``payload_bytes`` (integer: the payload's length, padding included) and ``tensors``: an array, in save
order, of objects with ``name``, ``dtype`` (a wire dtype name: ``float32``, ``float16``, ``bfloat16`` as
its uint16 bit patterns, ``int64``, ``int32``, ``uint8``, ``bool`` as bytes 0/1), ``shape`` (array of
integers), ``offset`` (integer, from ``P``) and ``nbytes`` (integer). A tensor's bytes are its elements
in C order, little-endian, unpadded, exactly as on the wire (docs/wire-format.md section 4). The file
therefore is ``P + payload_bytes + 32`` bytes long.

Every read hashes the whole file and compares the digest with its last 32 bytes before parsing
anything else: a mismatch raises CheckpointCorruptError naming the file and both digests.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import struct
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edgeswarm.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointValueError,
    CheckpointVersionError,
)
from edgeswarm.values.checkpoints import (
    MAX_TENSORS,
    CheckpointInfo,
    MetaValue,
    SafeName,
    TensorEntry,
    TensorLike,
    as_wire,
    check_meta,
    check_name,
    check_tensor_name,
    check_version,
    stage_name,
)
from edgeswarm.wire.tensor import raw_bytes, storage_dtype

log = logging.getLogger(__name__)

MAGIC = b"ESCKPT"
FORMAT = 1
PREFIX = struct.Struct("<6sHI")  # magic, format version, header length
ALIGN = 64
DIGEST_BYTES = 32
MAX_HEADER_BYTES = 256 * 1024 * 1024
_VERSION_FILE = re.compile(r"^v(\d{10})\.ckpt$")
_TEMP_SUFFIX = ".tmp"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _FileTensor(TensorEntry):
    offset: int = Field(ge=0)


class _FileHeader(BaseModel):
    """The JSON header of a checkpoint file (format 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: int
    job_id: SafeName
    stage: SafeName
    version: int = Field(ge=0)
    created_at: float
    meta: dict[str, MetaValue]
    payload_bytes: int = Field(ge=0)
    tensors: list[_FileTensor] = Field(max_length=MAX_TENSORS)


class CheckpointStore:
    """Versioned checkpoints in ``directory`` (created on the first write), ``keep`` versions per (job, stage).

    Thread-safe; one process should write a directory at a time (the checkpoint-store service is that
    process). Reads may run in other processes at any time.
    """

    def __init__(self, directory: Path | str, keep: int = 3) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise CheckpointValueError(f"keep must be an integer of at least 1, not {keep!r}")
        self.directory = Path(directory).expanduser()
        self.keep = keep
        self._write_lock = threading.Lock()

    # --- paths and listings -------------------------------------------------------------------------

    def stage_dir(self, job_id: str, stage: str | int) -> Path:
        """The folder of one (job, stage). Raises CheckpointValueError for an unsafe job id or stage."""
        return self.directory / check_name(job_id, "job id") / stage_name(stage)

    def path(self, job_id: str, stage: str | int, version: int) -> Path:
        """The file of one version (whether or not it exists)."""
        return self.stage_dir(job_id, stage) / f"v{check_version(version):010d}.ckpt"

    def versions(self, job_id: str, stage: str | int) -> list[int]:
        """The stored versions of (job, stage), ascending; [] if there are none."""
        folder = self.stage_dir(job_id, stage)
        try:
            names = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(int(m.group(1)) for n in names if (m := _VERSION_FILE.fullmatch(n)))

    def stages(self, job_id: str) -> list[str]:
        """The stages of ``job_id`` that hold at least one version, sorted by name."""
        folder = self.directory / check_name(job_id, "job id")
        return sorted(s for s in _subfolders(folder) if self.versions(job_id, s))

    def list_jobs(self) -> list[str]:
        """Every job id with at least one stored version, sorted."""
        return sorted(j for j in _subfolders(self.directory) if self.stages(j))

    def listing(self, job_id: str | None = None) -> dict[str, dict[str, list[int]]]:
        """job id -> stage -> versions (ascending), for one job or for all of them."""
        jobs = self.list_jobs() if job_id is None else [check_name(job_id, "job id")]
        out = {j: {s: self.versions(j, s) for s in self.stages(j)} for j in jobs}
        return {j: stages for j, stages in out.items() if stages}

    # --- writing ------------------------------------------------------------------------------------

    def put(self, job_id: str, stage: str | int, version: int, tensors: Mapping[str, TensorLike],
            meta: Mapping[str, Any] | None = None) -> CheckpointInfo:
        """Store ``tensors`` (name -> numpy array, torch tensor or WireTensor) as ``version`` of (job, stage).

        An existing file of the same version is replaced atomically. Afterwards only the ``keep``
        highest versions remain. Raises CheckpointValueError for unsafe names, a bad version, an
        unsupported dtype or bad meta; CheckpointVersionError for a version that would be pruned at once
        (older than the ``keep`` newest); OSError when the disk refuses (full, read-only, ...).
        """
        job_id = check_name(job_id, "job id")
        stage = stage_name(stage)
        version = check_version(version)
        meta = check_meta(meta)
        if len(tensors) > MAX_TENSORS:
            raise CheckpointValueError(f"{len(tensors)} tensors; a checkpoint holds at most {MAX_TENSORS}")
        items = [(check_tensor_name(name), *as_wire(value, name)) for name, value in tensors.items()]
        entries: list[_FileTensor] = []
        offset = 0
        for name, dtype, storage in items:
            offset = _align(offset)
            entries.append(_FileTensor(name=name, dtype=dtype, shape=tuple(storage.shape), nbytes=storage.nbytes,
                                       offset=offset))
            offset += storage.nbytes
        header = _FileHeader(format=FORMAT, job_id=job_id, stage=stage, version=version, created_at=time.time(),
                             meta=meta, payload_bytes=_align(offset), tensors=entries)
        header_bytes = json.dumps(header.model_dump(mode="json"), separators=(",", ":")).encode()

        with self._write_lock:
            existing = self.versions(job_id, stage)
            newest = sorted(set(existing) | {version})[-self.keep:]
            if version not in newest:
                raise CheckpointVersionError(
                    f"version {version} of {job_id}/{stage} is older than the {self.keep} kept versions "
                    f"{existing[-self.keep:]}; it would be deleted at once. Save a newer version, or raise "
                    "EDGESWARM_CHECKPOINT_KEEP")
            final = self.path(job_id, stage, version)
            pieces = [(entry, storage) for entry, (_, _, storage) in zip(entries, items, strict=True)]
            digest, size = self._write_atomically(final, header_bytes, pieces)
            self._prune(job_id, stage)
        info = _info(header, size, digest)
        log.info("stored %s/%s version %d: %d tensors, %d bytes in %s", job_id, stage, version, len(entries),
                 info.nbytes, final)
        return info

    def _write_atomically(self, final: Path, header_bytes: bytes,
                          tensors: list[tuple[_FileTensor, np.ndarray]]) -> tuple[str, int]:
        folder = final.parent
        _make_dirs(folder)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=_TEMP_SUFFIX, dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                digest = hashlib.sha256()

                def write(data: bytes | memoryview) -> None:
                    f.write(data)
                    digest.update(data)

                start = _align(PREFIX.size + len(header_bytes))
                write(PREFIX.pack(MAGIC, FORMAT, len(header_bytes)))
                write(header_bytes)
                write(bytes(start - PREFIX.size - len(header_bytes)))
                position = 0
                for entry, storage in tensors:
                    if entry.offset > position:
                        write(bytes(entry.offset - position))
                    write(raw_bytes(storage))
                    position = entry.offset + entry.nbytes
                write(bytes(_align(position) - position))
                f.write(digest.digest())
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        _fsync_dir(folder)
        return digest.hexdigest(), size

    def _prune(self, job_id: str, stage: str) -> None:
        versions = self.versions(job_id, stage)
        stale = versions[:-self.keep]
        for version in stale:
            try:
                os.unlink(self.path(job_id, stage, version))
            except FileNotFoundError:
                pass
        if stale:
            _fsync_dir(self.stage_dir(job_id, stage))
            log.info("pruned %s/%s versions %s (keeping the %d newest)", job_id, stage, stale, self.keep)

    def sweep_temp_files(self) -> int:
        """Delete temporary files left by interrupted writes; returns how many. Call only while no write runs."""
        removed = 0
        for job in _subfolders(self.directory):
            for stage in _subfolders(self.directory / job):
                folder = self.directory / job / stage
                for name in os.listdir(folder):
                    if name.startswith(".") and name.endswith(_TEMP_SUFFIX):
                        try:
                            os.unlink(folder / name)
                            removed += 1
                        except OSError as exc:
                            log.warning("cannot remove the leftover temporary file %s: %s", folder / name, exc)
        if removed:
            log.info("removed %d temporary file(s) left by interrupted checkpoint writes", removed)
        return removed

    # --- reading ------------------------------------------------------------------------------------

    def latest(self, job_id: str, stage: str | int) -> int | None:
        """The highest stored version of (job, stage), or None."""
        versions = self.versions(job_id, stage)
        return versions[-1] if versions else None

    def get(self, job_id: str, stage: str | int,
            version: int | None = None) -> tuple[CheckpointInfo, dict[str, np.ndarray]]:
        """Read ``version`` (None: the latest) of (job, stage), verifying its checksum.

        Returns its info and name -> array in save order; the arrays are writable views of one buffer,
        bfloat16 ones as their uint16 bit patterns (``info.tensors`` names the dtypes; ``as_torch`` turns
        them into torch tensors). Raises CheckpointNotFoundError (listing the versions there are),
        CheckpointCorruptError (checksum mismatch or malformed file) or CheckpointValueError.
        """
        job_id = check_name(job_id, "job id")
        stage = stage_name(stage)
        if version is None:
            latest = self.latest(job_id, stage)
            if latest is None:
                raise CheckpointNotFoundError(self._missing(job_id, stage, None))
            version = latest
        path = self.path(job_id, stage, version)
        try:
            return read_checkpoint(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(self._missing(job_id, stage, version)) from None

    def _missing(self, job_id: str, stage: str, version: int | None) -> str:
        what = f"{job_id}/{stage}" if version is None else f"version {version} of {job_id}/{stage}"
        versions = self.versions(job_id, stage)
        if versions:
            return f"no checkpoint {what} in {self.directory}; stored versions: {versions}"
        stages = self.stages(job_id) if (self.directory / job_id).is_dir() else []
        if stages:
            return f"no checkpoint {what} in {self.directory}; job {job_id} has stages {stages}"
        return f"no checkpoint {what} in {self.directory}: the store has no job {job_id!r}"


def read_checkpoint(path: Path | str) -> tuple[CheckpointInfo, dict[str, np.ndarray]]:
    """Read and verify one checkpoint file (format above). Raises FileNotFoundError, CheckpointCorruptError."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    if got != size:
        raise CheckpointCorruptError(f"checkpoint {path} shrank while it was read ({got} of {size} bytes); "
                                     "is another process writing it?")
    if size < PREFIX.size + DIGEST_BYTES:
        raise CheckpointCorruptError(f"checkpoint {path} is corrupt: {size} bytes is too short for a checkpoint "
                                     "file (truncated?)")
    expected = bytes(view[size - DIGEST_BYTES:]).hex()
    actual = hashlib.sha256(view[: size - DIGEST_BYTES]).hexdigest()
    if actual != expected:
        raise CheckpointCorruptError(
            f"checkpoint {path} is corrupt: its content hashes to SHA-256 {actual} but the file records {expected}; "
            "it was damaged after it was written (disk or file system error, or an edit). Load another version "
            "or delete this file")
    magic, fmt, header_len = PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CheckpointCorruptError(f"{path} is not a checkpoint file (magic {magic!r}, expected {MAGIC!r})")
    if fmt != FORMAT:
        raise CheckpointCorruptError(f"checkpoint {path} has format version {fmt}; this build reads version "
                                     f"{FORMAT}. Upgrade edgeswarm")
    try:
        if header_len > min(MAX_HEADER_BYTES, size - PREFIX.size - DIGEST_BYTES):
            raise ValueError(f"header length {header_len} does not fit the file")
        header = _FileHeader.model_validate(json.loads(bytes(view[PREFIX.size: PREFIX.size + header_len])))
        if header.format != FORMAT:
            raise ValueError(f"header format {header.format}")
        start = _align(PREFIX.size + header_len)
        if start + header.payload_bytes + DIGEST_BYTES != size:
            raise ValueError(f"header says {header.payload_bytes} payload bytes at offset {start}, the file has "
                             f"{size - DIGEST_BYTES - start}")
        arrays: dict[str, np.ndarray] = {}
        for t in header.tensors:
            storage = storage_dtype(t.dtype)
            if math.prod(t.shape) * storage.itemsize != t.nbytes or t.offset + t.nbytes > header.payload_bytes:
                raise ValueError(f"tensor {t.name!r} ({t.dtype} {list(t.shape)}, {t.nbytes} bytes at {t.offset}) "
                                 "is inconsistent")
            if t.name in arrays:
                raise ValueError(f"tensor {t.name!r} appears twice")
            arrays[t.name] = np.frombuffer(buf, dtype=storage, count=math.prod(t.shape),
                                           offset=start + t.offset).reshape(t.shape)
    except (ValueError, ValidationError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"checkpoint {path} is malformed although its checksum matches (written by "
                                     f"a faulty writer?): {str(exc).splitlines()[0]}") from None
    return _info(header, size, expected), arrays


def _info(header: _FileHeader, file_bytes: int, sha256: str) -> CheckpointInfo:
    return CheckpointInfo(
        job_id=header.job_id, stage=header.stage, version=header.version, created_at=header.created_at,
        meta=header.meta, tensors=tuple(TensorEntry(name=t.name, dtype=t.dtype, shape=t.shape, nbytes=t.nbytes)
                                        for t in header.tensors),
        nbytes=sum(t.nbytes for t in header.tensors), file_bytes=file_bytes, sha256=sha256)


def _subfolders(folder: Path) -> Iterable[str]:
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [e.name for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]


def _make_dirs(folder: Path) -> None:
    """Create ``folder`` and its missing parents, fsyncing each parent so the new entries are durable."""
    missing = []
    current = folder
    while not current.exists():
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:
            pass
        _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make a rename or unlink in ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
