"""Checkpoints on disk: versioned tensor sets per (job, stage) as safetensors files, written atomically, checked on
every read.

Layout under the store's directory (``EDGESWARM_CHECKPOINT_DIR``)::

    {job_id}/{stage}/v{version:010d}.json                    the version's manifest: it exists iff the version does
    {job_id}/{stage}/v{version:010d}-{sha256[:16]}.safetensors   its tensors, a standard safetensors file
    {job_id}/{stage}/.*.tmp                                  a write in progress (or left by a crash; never read)

The tensor file is what any safetensors reader loads (``safetensors.torch.load_file``); its header's metadata says
which job, stage and version it is. The manifest (docs/checkpoints.md) holds everything else: the version's meta
(step counters, optimizer settings, ...), the tensors in save order with their dtypes and shapes, and the tensor
file's name, size and SHA-256. A write puts the tensor file in place first (a temporary file in the same folder,
fsynced, renamed) under a name carrying its digest, then the manifest the same way, then fsyncs the folder: a
reader sees the old version or the new one, never part of one, and a crash at any point leaves every earlier
version intact (an orphaned tensor file is removed by ``sweep_temp_files``).

Only the ``keep`` highest versions of each (job, stage) are kept; older ones are deleted after each write.

Every read checks the tensor file's size against the manifest and ``max_bytes`` before reading it, hashes the
whole file and compares the digest with the manifest's before the safetensors library parses it: a mismatch
raises CheckpointCorruptError naming the file and both digests. Files of edgeswarm's earlier checkpoint format
(``v{version}.ckpt``) are not read: they are reported with CheckpointFormatError.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edgeswarm.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointTooLargeError,
    CheckpointValueError,
    CheckpointVersionError,
)
from edgeswarm.files import TEMP_SUFFIX, fsync_dir, make_dirs, sync_and_hash, temporary_beside, write_atomically
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
from edgeswarm.wire.tensor import storage_dtype

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FORMAT = 2
LEGACY_MAGIC = b"ESCKPT"  # the first bytes of a format-1 ``.ckpt`` file
MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # 100,000 tensor entries of long names fit easily
HEADER_ALLOWANCE = 64 * 1024 * 1024  # a tensor file's safetensors header, on top of its tensor bytes
DEFAULT_MAX_BYTES = 2048 * 1024 * 1024  # the default of EDGESWARM_CHECKPOINT_MAX_BYTES
_MANIFEST = re.compile(r"^v(\d{10})\.json$")
_DATA = re.compile(r"^v(\d{10})-[0-9a-f]{16}\.safetensors$")
_LEGACY = re.compile(r"^v(\d{10})\.ckpt$")

# Wire dtype names and the safetensors dtype codes they are stored as (both directions are one to one).
SAFETENSORS_DTYPES: dict[str, str] = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32", "uint8": "U8",
    "bool": "BOOL",
}
_WIRE_DTYPES = {code: name for name, code in SAFETENSORS_DTYPES.items()}


class Manifest(BaseModel):
    """The manifest of one stored version (``v{version:010d}.json``): what the tensor file ``file`` holds (in save
    order), its size in bytes and SHA-256, and the version's meta; ``created_at`` is Unix seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal[2]
    job_id: SafeName
    stage: SafeName
    version: int = Field(ge=0)
    created_at: float
    meta: dict[str, MetaValue]
    tensors: list[TensorEntry] = Field(max_length=MAX_TENSORS)
    file: str = Field(pattern=_DATA.pattern)
    file_bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class CheckpointStore:
    """Versioned checkpoints in ``directory`` (created on the first write), ``keep`` versions per (job, stage), each
    version's tensor file at most ``max_bytes`` of tensors (EDGESWARM_CHECKPOINT_MAX_BYTES).

    Thread-safe; one process should write a directory at a time (the checkpoint-store service is that
    process). Reads may run in other processes at any time.
    """

    def __init__(self, directory: Path | str, keep: int = 3, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise CheckpointValueError(f"keep must be an integer of at least 1, not {keep!r}")
        self.directory = Path(directory).expanduser()
        self.keep = keep
        self.max_bytes = max_bytes
        self._write_lock = threading.Lock()

    # --- paths and listings -------------------------------------------------------------------------

    def stage_dir(self, job_id: str, stage: str | int) -> Path:
        """The folder of one (job, stage). Raises CheckpointValueError for an unsafe job id or stage."""
        return self.directory / check_name(job_id, "job id") / stage_name(stage)

    def path(self, job_id: str, stage: str | int, version: int) -> Path:
        """The manifest of one version (whether or not it exists); ``read_checkpoint`` reads a version by it."""
        return self.stage_dir(job_id, stage) / f"v{check_version(version):010d}.json"

    def data_path(self, job_id: str, stage: str | int, version: int) -> Path:
        """The safetensors file of one stored version, as its manifest names it. Raises CheckpointNotFoundError
        when there is no such version and CheckpointCorruptError when its manifest is unreadable."""
        manifest = self.path(job_id, stage, version)
        try:
            return manifest.parent / _read_manifest(manifest).file
        except FileNotFoundError:
            raise CheckpointNotFoundError(self._missing(job_id, stage_name(stage), version)) from None

    def versions(self, job_id: str, stage: str | int) -> list[int]:
        """The stored versions of (job, stage), ascending; [] if there are none."""
        return sorted(int(m.group(1)) for n in self._names(self.stage_dir(job_id, stage))
                      if (m := _MANIFEST.fullmatch(n)))

    @staticmethod
    def _names(folder: Path) -> list[str]:
        try:
            return os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            return []

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
        (older than the ``keep`` newest); CheckpointTooLargeError beyond ``max_bytes`` of tensors; OSError when
        the disk refuses (full, read-only, ...).
        """
        job_id = check_name(job_id, "job id")
        stage = stage_name(stage)
        version = check_version(version)
        meta = check_meta(meta)
        if len(tensors) > MAX_TENSORS:
            raise CheckpointValueError(f"{len(tensors)} tensors; a checkpoint holds at most {MAX_TENSORS}")
        items = [(check_tensor_name(name), *as_wire(value, name)) for name, value in tensors.items()]
        nbytes = sum(storage.nbytes for _, _, storage in items)
        if nbytes > self.max_bytes:
            raise CheckpointTooLargeError(f"{job_id}/{stage} version {version} holds {nbytes} bytes of tensors; the "
                                          f"store accepts at most {self.max_bytes} (EDGESWARM_CHECKPOINT_MAX_BYTES)")
        entries = [TensorEntry(name=name, dtype=dtype, shape=tuple(storage.shape), nbytes=storage.nbytes)
                   for name, dtype, storage in items]
        with self._write_lock:
            existing = self.versions(job_id, stage)
            newest = sorted(set(existing) | {version})[-self.keep:]
            if version not in newest:
                raise CheckpointVersionError(
                    f"version {version} of {job_id}/{stage} is older than the {self.keep} kept versions "
                    f"{existing[-self.keep:]}; it would be deleted at once. Save a newer version, or raise "
                    "EDGESWARM_CHECKPOINT_KEEP")
            final = self.path(job_id, stage, version)
            file_metadata = {"format": "pt", "edgeswarm.job_id": job_id, "edgeswarm.stage": stage,
                             "edgeswarm.version": str(version)}
            data_name, digest, size = self._write_tensors(final.parent, version, _as_torch(items), file_metadata)
            manifest = Manifest(format=FORMAT, job_id=job_id, stage=stage, version=version, created_at=time.time(),
                                meta=meta, tensors=entries, file=data_name, file_bytes=size, sha256=digest)
            try:
                write_atomically(final, json.dumps(manifest.model_dump(mode="json"), separators=(",", ":")).encode())
            except BaseException:
                self._remove_data_files(final.parent, version, keep_name=self._current_data(final))
                raise
            self._remove_data_files(final.parent, version, keep_name=data_name)
            self._prune(job_id, stage)
        info = _info(manifest)
        log.info("stored %s/%s version %d: %d tensors, %d bytes in %s", job_id, stage, version, len(entries),
                 info.nbytes, final.parent / data_name)
        return info

    def _write_tensors(self, folder: Path, version: int, tensors: dict[str, torch.Tensor],
                       metadata: dict[str, str]) -> tuple[str, str, int]:
        """Write ``tensors`` as a safetensors file in ``folder``; returns its name, SHA-256 and size in bytes."""
        from safetensors.torch import save_file

        make_dirs(folder)
        with temporary_beside(folder / f"v{version:010d}.safetensors") as tmp:
            save_file(tensors, tmp, metadata=metadata)
            digest, size = sync_and_hash(tmp)
            name = f"v{version:010d}-{digest[:16]}.safetensors"
            os.replace(tmp, folder / name)
        return name, digest, size

    def _current_data(self, manifest: Path) -> str | None:
        """The tensor file the manifest there names now, or None (no manifest, or an unreadable one)."""
        try:
            return _read_manifest(manifest).file
        except (OSError, CheckpointCorruptError):
            return None

    def _remove_data_files(self, folder: Path, version: int, keep_name: str | None) -> None:
        prefix = f"v{version:010d}-"
        for name in self._names(folder):
            if name.startswith(prefix) and _DATA.fullmatch(name) and name != keep_name:
                try:
                    os.unlink(folder / name)
                except FileNotFoundError:
                    pass

    def _prune(self, job_id: str, stage: str) -> None:
        versions = self.versions(job_id, stage)
        stale = versions[:-self.keep]
        folder = self.stage_dir(job_id, stage)
        for version in stale:
            try:
                os.unlink(self.path(job_id, stage, version))  # the version is gone once its manifest is
            except FileNotFoundError:
                pass
            self._remove_data_files(folder, version, keep_name=None)
        if stale:
            fsync_dir(folder)
            log.info("pruned %s/%s versions %s (keeping the %d newest)", job_id, stage, stale, self.keep)

    def sweep_temp_files(self) -> int:
        """Delete temporary files and tensor files no manifest names, left by interrupted writes; returns how many.
        Call only while no write runs."""
        removed = 0
        for job in _subfolders(self.directory):
            for stage in _subfolders(self.directory / job):
                folder = self.directory / job / stage
                names = self._names(folder)
                named = {self._current_data(folder / n) for n in names if _MANIFEST.fullmatch(n)}
                for name in names:
                    temporary = name.startswith(".") and name.endswith(TEMP_SUFFIX)
                    if temporary or (_DATA.fullmatch(name) and name not in named):
                        try:
                            os.unlink(folder / name)
                            removed += 1
                        except OSError as exc:
                            log.warning("cannot remove the leftover file %s: %s", folder / name, exc)
        if removed:
            log.info("removed %d file(s) left by interrupted checkpoint writes", removed)
        return removed

    # --- reading ------------------------------------------------------------------------------------

    def latest(self, job_id: str, stage: str | int) -> int | None:
        """The highest stored version of (job, stage), or None."""
        versions = self.versions(job_id, stage)
        return versions[-1] if versions else None

    def get(self, job_id: str, stage: str | int,
            version: int | None = None) -> tuple[CheckpointInfo, dict[str, np.ndarray]]:
        """Read ``version`` (None: the latest) of (job, stage), verifying its checksum.

        Returns its info and name -> array in save order; the arrays are writable, bfloat16 ones as their uint16
        bit patterns (``info.tensors`` names the dtypes; ``as_torch`` turns them into torch tensors). Raises
        CheckpointNotFoundError (listing the versions there are), CheckpointFormatError (only files of the old
        format are there), CheckpointCorruptError (checksum mismatch or malformed file), CheckpointTooLargeError
        or CheckpointValueError.
        """
        job_id = check_name(job_id, "job id")
        stage = stage_name(stage)
        if version is None:
            latest = self.latest(job_id, stage)
            if latest is None:
                self._refuse_legacy(job_id, stage, None)
                raise CheckpointNotFoundError(self._missing(job_id, stage, None))
            version = latest
        path = self.path(job_id, stage, version)
        try:
            info, arrays = read_checkpoint(path, max_bytes=self.max_bytes)
        except FileNotFoundError:
            self._refuse_legacy(job_id, stage, version)
            raise CheckpointNotFoundError(self._missing(job_id, stage, version)) from None
        if (info.job_id, info.stage) != (job_id, stage):
            raise CheckpointCorruptError(f"checkpoint manifest {path} is corrupt: it describes {info.job_id}/"
                                         f"{info.stage}, not {job_id}/{stage}")
        return info, arrays

    def _refuse_legacy(self, job_id: str, stage: str, version: int | None) -> None:
        """Raise CheckpointFormatError when (job, stage) has files of the old format where the version was asked."""
        folder = self.stage_dir(job_id, stage)
        legacy = sorted(n for n in self._names(folder) if (m := _LEGACY.fullmatch(n))
                        and (version is None or int(m.group(1)) == version))
        if legacy:
            raise CheckpointFormatError(_legacy_message(folder / legacy[-1]))

    def _missing(self, job_id: str, stage: str, version: int | None) -> str:
        what = f"{job_id}/{stage}" if version is None else f"version {version} of {job_id}/{stage}"
        versions = self.versions(job_id, stage)
        if versions:
            return f"no checkpoint {what} in {self.directory}; stored versions: {versions}"
        stages = self.stages(job_id) if (self.directory / job_id).is_dir() else []
        if stages:
            return f"no checkpoint {what} in {self.directory}; job {job_id} has stages {stages}"
        return f"no checkpoint {what} in {self.directory}: the store has no job {job_id!r}"


def _legacy_message(path: Path) -> str:
    return (f"{path} is a checkpoint in edgeswarm's earlier format (a .ckpt file), which this version no longer "
            "reads: checkpoints are safetensors files now. Delete the old files (or the folder) and train the job "
            "again")


def _read_manifest(path: Path) -> Manifest:
    """The validated manifest at ``path``. Raises FileNotFoundError, CheckpointCorruptError."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointCorruptError(f"checkpoint manifest {path} is corrupt: {size} bytes, more than any "
                                         f"manifest ({MAX_MANIFEST_BYTES})")
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"checkpoint manifest {path} is corrupt: not JSON ({exc})") from None
    if isinstance(data, dict) and data.get("format") != FORMAT:
        raise CheckpointFormatError(f"checkpoint manifest {path} has format {data.get('format')!r}; this build "
                                    f"reads format {FORMAT}. Upgrade edgeswarm")
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise CheckpointCorruptError(f"checkpoint manifest {path} is malformed: "
                                     f"{str(exc).splitlines()[0]}; {exc.errors()[0]['msg']}") from None


def read_checkpoint(path: Path | str, *,
                    max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[CheckpointInfo, dict[str, np.ndarray]]:
    """Read and verify one stored version by its manifest ``path`` (``CheckpointStore.path``); ``max_bytes`` caps
    its tensor bytes (the file may be HEADER_ALLOWANCE bytes larger). Raises FileNotFoundError (no manifest),
    CheckpointFormatError (a file of the old format), CheckpointCorruptError, CheckpointTooLargeError."""
    path = Path(path)
    if _LEGACY.fullmatch(path.name):
        raise CheckpointFormatError(_legacy_message(path))
    manifest = _read_manifest(path)
    named = _MANIFEST.fullmatch(path.name)
    if named is not None and int(named.group(1)) != manifest.version:
        raise CheckpointCorruptError(f"checkpoint manifest {path} is corrupt: it describes version {manifest.version}")
    data_path = path.parent / manifest.file
    limit = max_bytes + HEADER_ALLOWANCE
    try:
        with open(data_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != manifest.file_bytes:
                raise CheckpointCorruptError(
                    f"checkpoint {data_path} is corrupt: it is {size} bytes but its manifest {path.name} records "
                    f"{manifest.file_bytes} (truncated or replaced). Load another version or delete this one")
            if size > limit:
                raise CheckpointTooLargeError(
                    f"checkpoint {data_path} is {size} bytes; this store reads at most {limit} (tensors up to "
                    "EDGESWARM_CHECKPOINT_MAX_BYTES plus the header); raise EDGESWARM_CHECKPOINT_MAX_BYTES to read it")
            raw = f.read(size + 1)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"checkpoint {path} is corrupt: its tensor file {manifest.file} is missing. "
                                     "Load another version or delete this one") from None
    if len(raw) != size:
        raise CheckpointCorruptError(f"checkpoint {data_path} changed size while it was read ({len(raw)} of {size} "
                                     "bytes); is another process writing it?")
    actual = hashlib.sha256(raw).hexdigest()
    if actual != manifest.sha256:
        raise CheckpointCorruptError(
            f"checkpoint {data_path} is corrupt: its content hashes to SHA-256 {actual} but its manifest records "
            f"{manifest.sha256}; it was damaged after it was written (disk or file system error, or an edit). Load "
            "another version or delete this one")
    return _info(manifest), _parse(raw, manifest, data_path)


def _parse(raw: bytes, manifest: Manifest, path: Path) -> dict[str, np.ndarray]:
    """The arrays of a verified tensor file, in the manifest's order, checked against what the manifest lists."""
    from safetensors import SafetensorError, deserialize

    if raw.startswith(LEGACY_MAGIC):
        raise CheckpointFormatError(_legacy_message(path))
    try:
        parsed = deserialize(raw)
    except (SafetensorError, ValueError) as exc:
        raise CheckpointCorruptError(f"checkpoint {path} is malformed although its checksum matches (written by a "
                                     f"faulty writer?): {exc}") from None
    expected = {t.name: t for t in manifest.tensors}
    arrays: dict[str, np.ndarray] = {}
    for name, view in parsed:
        entry = expected.get(name)
        dtype = _WIRE_DTYPES.get(view["dtype"])
        if entry is None or dtype != entry.dtype or tuple(view["shape"]) != entry.shape or \
                len(view["data"]) != entry.nbytes:
            raise CheckpointCorruptError(
                f"checkpoint {path} holds tensor {name!r} ({view['dtype']} {list(view['shape'])}), which its "
                "manifest does not list as such; the two files do not belong together")
        array = np.frombuffer(view["data"], dtype=storage_dtype(dtype)).reshape(entry.shape)
        arrays[name] = array if array.flags.writeable else array.copy()
    missing = [name for name in expected if name not in arrays]
    if missing:
        raise CheckpointCorruptError(f"checkpoint {path} lacks tensors its manifest lists: {missing[:8]}")
    return {name: arrays[name] for name in expected}


def _as_torch(items: list[tuple[str, str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Wire storage arrays as the torch tensors safetensors writes (bfloat16 restored), none sharing memory."""
    import torch

    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    with warnings.catch_warnings():
        # Uploaded arrays may be read-only views of a received frame; torch warns, and nothing writes to them.
        warnings.simplefilter("ignore", UserWarning)
        for name, dtype, storage in items:
            key = (storage.ctypes.data, storage.nbytes)
            if storage.nbytes and key in seen:
                storage = storage.copy()  # one array under two names (tied weights): safetensors wants two
            seen.add(key)
            if dtype == "bfloat16":
                out[name] = torch.from_numpy(storage.view(np.int16)).view(torch.bfloat16)
            else:
                out[name] = torch.from_numpy(storage)
    return out


def _info(manifest: Manifest) -> CheckpointInfo:
    return CheckpointInfo(
        job_id=manifest.job_id, stage=manifest.stage, version=manifest.version, created_at=manifest.created_at,
        meta=manifest.meta, tensors=tuple(manifest.tensors), nbytes=sum(t.nbytes for t in manifest.tensors),
        file_bytes=manifest.file_bytes, sha256=manifest.sha256)


def _subfolders(folder: Path) -> Iterable[str]:
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [e.name for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
