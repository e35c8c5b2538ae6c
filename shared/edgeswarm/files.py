"""Files written all or nothing, for everything edgeswarm keeps on disk (checkpoints, model files, profiles,
credentials).

A file is written under a temporary name in its own folder (``.NAME.XXXX.tmp``: hidden, and recognisable so a
store can sweep leftovers of a crash), fsynced, then renamed over its final name, and the folder is fsynced so the
rename itself survives a power cut. A reader therefore sees the old file or the new one, never a half-written one.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from edgeswarm.errors import ConfigError

TEMP_SUFFIX = ".tmp"
_HASH_CHUNK = 4 * 1024 * 1024


def output_file(path: str) -> Path:
    """``path`` as a file a command may write at its end, checked before the command's work: not a folder, no file
    where its folders would go, and writable (the file, or the nearest of its folders that exists). Raises
    ConfigError, so that a bench does not run for minutes and then fail to keep its report."""
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"{path} is a folder: give a file name in it, such as {out / 'report.json'}")
    folder = next(p for p in out.parents if p.exists())  # "." or "/" at the latest
    if not folder.is_dir():
        raise ConfigError(f"{path}: {folder} is a file, not a folder")
    target = out if out.exists() else folder
    if not os.access(target, os.W_OK):
        raise ConfigError(f"{path}: {target} is not writable by this user")
    return out


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the file ``path`` (made, with its folder, when missing) for the block: another
    process taking the same lock waits until the block ends. Raises OSError when the file cannot be opened."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fsync_dir(folder: Path) -> None:
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


def make_dirs(folder: Path) -> None:
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
        fsync_dir(path.parent)


@contextmanager
def temporary_beside(final: Path, mode: int | None = None) -> Iterator[Path]:
    """A new empty file in ``final``'s folder (which must exist), for the block to fill and then ``os.replace``
    over ``final`` (or any name in that folder). It is deleted when the block raises. ``mode``: its permission
    bits, set before anything is written (0o600 for secrets). Raises OSError when the folder cannot be written."""
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=TEMP_SUFFIX, dir=final.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
    try:
        yield Path(tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sync_and_hash(path: Path) -> tuple[str, int]:
    """fsync the file at ``path`` and return its SHA-256 (hex) and its size in bytes, read in bounded chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return digest.hexdigest(), size


def write_atomically(final: Path, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``final`` all or nothing (module docstring), creating its folder. ``mode``: the file's
    permission bits (default: the umask's). Raises OSError."""
    make_dirs(final.parent)
    with temporary_beside(final, mode) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    fsync_dir(final.parent)
