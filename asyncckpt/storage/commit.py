"""Commit, manifest, ``latest`` pointer, retention and verification.

A checkpoint is written into a hidden temporary directory beside its final name. The
commit (run by the coordinator in finalize, after every rank's files are durable)
writes ``.metadata`` (the DCP metadata) and ``.manifest.json`` (per-file sizes and
CRC-32 checksummed segments), fsyncs them and the directory, renames the directory to
its final name, and fsyncs the parent. A reader therefore sees either no checkpoint or
a complete one. ``latest`` is replaced atomically (temporary file, fsync, rename,
fsync) under a file lock (:mod:`filelock`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
import zlib
from pathlib import Path
from typing import Any, Iterable

from filelock import FileLock

from .. import _faults
from ..errors import CorruptCheckpointError
from .writer import FileResult, fsync_directory

__all__ = [
    "METADATA_NAME",
    "MANIFEST_NAME",
    "LATEST_NAME",
    "temporary_dir_for",
    "commit_directory",
    "read_manifest",
    "verify_checkpoint",
    "is_committed",
    "write_latest",
    "read_latest",
    "remove_checkpoint",
]

METADATA_NAME = ".metadata"
MANIFEST_NAME = ".manifest.json"
LATEST_NAME = "latest"
LOCK_NAME = ".asyncckpt.lock"
MANIFEST_FORMAT = "asyncckpt.manifest"
MANIFEST_VERSION = 1
_READ_CHUNK = 16 << 20


def temporary_dir_for(final_dir: Path, token: str) -> Path:
    """The hidden temporary directory a checkpoint is written into before commit."""
    return final_dir.parent / f".{final_dir.name}.tmp-{token}"


def _write_new_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_directory(
    tmp_dir: Path,
    final_dir: Path,
    metadata_bytes: bytes,
    files: Iterable[FileResult],
    info: dict[str, Any],
) -> dict[str, Any]:
    """Write metadata and manifest into ``tmp_dir`` and rename it to ``final_dir``.

    Args:
        tmp_dir: the temporary directory holding every rank's data files (durable).
        final_dir: the committed name; must not exist, or be an empty directory.
        metadata_bytes: the pickled ``torch.distributed.checkpoint.metadata.Metadata``.
        files: every rank's written files.
        info: extra fields for the manifest (world_size, step, ...).

    Returns:
        The manifest.

    Raises:
        FileExistsError: ``final_dir`` exists and is not empty.
        OSError: any I/O failure; ``final_dir`` is then not created.
    """
    _write_new_file(tmp_dir / METADATA_NAME, metadata_bytes)
    entries = {f.name: {"size": f.nbytes, "segments": [list(s) for s in f.segments]} for f in files}
    entries[METADATA_NAME] = {
        "size": len(metadata_bytes),
        "segments": [[0, len(metadata_bytes), zlib.crc32(metadata_bytes)]],
    }
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "checksum": "crc32",
        "created_unix_s": time.time(),
        "total_bytes": sum(e["size"] for e in entries.values()),
        **info,
        "files": dict(sorted(entries.items())),
    }
    _write_new_file(tmp_dir / MANIFEST_NAME, json.dumps(manifest, indent=1).encode())
    fsync_directory(str(tmp_dir))
    _faults.hit("commit")
    if final_dir.exists() and any(final_dir.iterdir()):
        raise FileExistsError(f"{final_dir} exists and is not empty; it is never overwritten")
    os.rename(tmp_dir, final_dir)  # atomic; replaces an empty directory
    fsync_directory(str(final_dir.parent))
    return manifest


def read_manifest(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """Read and sanity-check a checkpoint's manifest.

    Raises:
        CorruptCheckpointError: missing, unreadable, or naming a path outside the
            checkpoint directory.
    """
    path = Path(checkpoint_dir) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: {checkpoint_dir} is not a committed checkpoint",
                                     str(path)) from None
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path} cannot be read: {exc}", str(path)) from exc
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpointError(f"{path} is not an asyncckpt manifest", str(path))
    for name in manifest["files"]:
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name:
            raise CorruptCheckpointError(f"{path} names a file outside the checkpoint: {name!r}", str(path))
    return manifest


def is_committed(checkpoint_dir: Path) -> bool:
    """True if ``checkpoint_dir`` is a directory with a manifest and DCP metadata."""
    return (checkpoint_dir / MANIFEST_NAME).is_file() and (checkpoint_dir / METADATA_NAME).is_file()


def verify_checkpoint(checkpoint_dir: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, Any]:
    """Check sizes and CRC-32 checksums of a checkpoint's files against its manifest.

    Args:
        checkpoint_dir: the committed checkpoint directory.
        names: check only these files (default: all files of the manifest).

    Returns:
        The manifest.

    Raises:
        CorruptCheckpointError: naming the first file that is missing, has the wrong
            size, is a symlink, or whose bytes do not match a checksum.
    """
    root = Path(checkpoint_dir)
    manifest = read_manifest(root)
    files = manifest["files"]
    for name in (sorted(files) if names is None else names):
        entry = files[name]
        path = root / name
        if path.is_symlink():
            raise CorruptCheckpointError(f"{path} is a symlink; checkpoint files must be regular files", str(path))
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path} is missing (listed in the manifest)", str(path)) from None
        if size != entry["size"]:
            raise CorruptCheckpointError(
                f"{path} has {size} bytes, the manifest says {entry['size']}", str(path))
        expected_pos = 0
        with open(path, "rb", buffering=0) as f:
            for offset, length, crc in entry["segments"]:
                if offset != expected_pos:
                    raise CorruptCheckpointError(f"{path}: manifest segments do not cover the file", str(path))
                actual, left = 0, length
                while left:
                    chunk = f.read(min(left, _READ_CHUNK))
                    if not chunk:
                        raise CorruptCheckpointError(f"{path} is truncated", str(path))
                    actual = zlib.crc32(chunk, actual)
                    left -= len(chunk)
                if actual != crc:
                    raise CorruptCheckpointError(
                        f"{path}: checksum mismatch in bytes [{offset}, {offset + length}) "
                        f"(crc32 {actual:08x}, manifest {crc:08x})", str(path))
                expected_pos = offset + length
        if expected_pos != entry["size"]:
            raise CorruptCheckpointError(f"{path}: manifest segments do not cover the file", str(path))
    return manifest


def write_latest(root: Path, name: str) -> None:
    """Point ``root/latest`` at checkpoint directory ``name``, atomically and durably."""
    with FileLock(str(root / LOCK_NAME)):
        tmp = root / f".{LATEST_NAME}.tmp-{secrets.token_hex(8)}"
        try:
            _write_new_file(tmp, (name + "\n").encode())
            os.replace(tmp, root / LATEST_NAME)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_directory(str(root))


def read_latest(root: Path) -> str | None:
    """The checkpoint directory name ``root/latest`` points at, or ``None``."""
    try:
        name = (root / LATEST_NAME).read_text().strip()
    except FileNotFoundError:
        return None
    if not name or os.path.basename(name) != name or name in (".", ".."):
        return None
    return name


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint directory: first renamed to a hidden name (so a crash
    mid-delete never leaves a partial directory under a committed name), then removed."""
    doomed = path.parent / f".{path.name}.deleting-{secrets.token_hex(6)}"
    os.rename(path, doomed)
    fsync_directory(str(path.parent))
    shutil.rmtree(doomed, ignore_errors=True)
