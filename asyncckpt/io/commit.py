"""The commit of the local tier, and the ``latest`` pointer.

A checkpoint is written into a hidden temporary directory beside its final name. The
commit (run by the coordinator in finalize, after every rank's files are durable)
writes ``.metadata`` (the DCP metadata) and ``.manifest.json`` (per-file sizes and
CRC-32 checksummed segments, :mod:`asyncckpt.format.manifest`), fsyncs them and the
directory, renames the directory to its final name, and fsyncs the parent. A reader
therefore sees either no checkpoint or a complete one. ``latest`` is replaced
atomically (temporary file, fsync, rename, fsync) under a file lock (:mod:`filelock`).

Torch-free.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from filelock import FileLock

from asyncckpt import _faults
from asyncckpt._fs import (
    fsync_directory,
    open_no_follow,
    write_new_file,
)
from asyncckpt.errors import CheckpointError, CorruptCheckpointError
from asyncckpt.format.manifest import (
    LATEST_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    METADATA_NAME,
    build_manifest,
    is_plain_name,
    manifest_bytes,
)
from asyncckpt.io.writer import FileResult

__all__ = [
    "temporary_dir_for",
    "commit_directory",
    "write_latest",
    "read_latest",
]


def temporary_dir_for(final_dir: Path, token: str) -> Path:
    """The hidden temporary directory a checkpoint is written into before commit."""
    return final_dir.parent / f".{final_dir.name}.tmp-{token}"


def commit_directory(
    tmp_dir: Path,
    final_dir: Path,
    metadata_bytes: bytes,
    files: Iterable[FileResult],
    info: dict[str, Any],
    small: Mapping[str, bytes] | None = None,
) -> dict[str, Any]:
    """Write metadata, the small files beside it and the manifest into ``tmp_dir`` and
    rename it to ``final_dir``.

    Args:
        tmp_dir: the temporary directory holding every rank's data files (durable).
        final_dir: the committed name; must not exist, or be an empty directory.
        metadata_bytes: the pickled ``torch.distributed.checkpoint.metadata.Metadata``.
        files: every rank's written files.
        info: extra fields for the manifest (world_size, step, ...).
        small: the small files beside ``.metadata``, name -> bytes (the records file,
            :func:`asyncckpt.format.records.records_file`, or the shard index and its
            chunk lines, :mod:`asyncckpt.format.shards`, of ``metadata_bytes``);
            ``None``: none.

    Returns:
        The manifest.

    Raises:
        FileExistsError: ``final_dir`` exists and is not empty.
        CorruptCheckpointError: a file of ``files`` is missing from ``tmp_dir`` or has
            another size (checked just before the rename): nothing is committed.
        OSError: any I/O failure; ``final_dir`` is then not created.
    """
    files = list(files)
    written = {METADATA_NAME: metadata_bytes, **(small or {})}
    for name, data in written.items():
        write_new_file(tmp_dir / name, data)
    manifest = build_manifest(files, written, info)
    write_new_file(tmp_dir / MANIFEST_NAME, manifest_bytes(manifest))
    fsync_directory(tmp_dir)
    _faults.hit("commit")
    _check_present(tmp_dir, final_dir, files)
    if final_dir.exists() and any(final_dir.iterdir()):
        raise FileExistsError(f"{final_dir} exists and is not empty; it is never overwritten")
    os.rename(tmp_dir, final_dir)  # atomic; replaces an empty directory
    fsync_directory(final_dir.parent)
    _faults.hit("after_rename")
    return manifest


def _check_present(tmp_dir: Path, final_dir: Path, files: list[FileResult]) -> None:
    """Every rank's data file is in ``tmp_dir``, with the size its writer reported (one
    ``lstat`` per file), so that a rename never commits a checkpoint missing a rank's data.

    Raises:
        CorruptCheckpointError: naming the first file missing or of another size.
    """
    for f in files:
        path = tmp_dir / f.name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{f.name} is missing from the temporary directory {tmp_dir} although the manifest lists it "
                f"(did every rank write into the same directory?); {final_dir} is not committed",
                str(path),
            ) from None
        if not stat.S_ISREG(st.st_mode) or st.st_size != f.nbytes:
            raise CorruptCheckpointError(
                f"{f.name} in {tmp_dir} has {st.st_size} bytes, its writer wrote {f.nbytes}; "
                f"{final_dir} is not committed",
                str(path),
            )


def _lock_path(root: Path) -> str:
    """``root/.asyncckpt.lock``, with any symlink at that name removed, never followed.

    Recent filelock releases (4.x) open the lock file with ``O_NOFOLLOW`` and then fail
    on a symlink (``ELOOP``), which would fail the save after its directory was
    renamed; older ones opened it with ``O_TRUNC`` through the symlink, truncating its
    target. A symlink is never our lock file, so it is unlinked.

    Raises:
        CheckpointError: the lock path exists and is neither a regular file nor a symlink.
    """
    lock = root / LOCK_NAME
    try:
        mode = os.lstat(lock).st_mode
    except FileNotFoundError:
        return str(lock)
    if stat.S_ISLNK(mode):
        try:
            os.unlink(lock)  # removes the link itself, not its target
        except FileNotFoundError:
            pass
    elif not stat.S_ISREG(mode):
        raise CheckpointError(f"{lock} exists and is not a regular file; it cannot be used as the lock file")
    return str(lock)


def write_latest(root: Path, name: str) -> None:
    """Point ``root/latest`` at checkpoint directory ``name``, atomically and durably.

    Under the file lock ``root/.asyncckpt.lock`` (:mod:`filelock`; a symlink there is
    removed, never followed), writes ``name`` to a new temporary file with a 64-bit
    random name (``O_EXCL``: never through an existing file or symlink), fsyncs it,
    renames it over ``latest`` (a symlink named ``latest`` is replaced, its target
    untouched) and fsyncs ``root``.

    Args:
        root: the directory holding ``latest``.
        name: a checkpoint directory name in ``root`` (a plain name, no separator).

    Raises:
        ValueError: ``name`` is not a plain file name.
        CheckpointError: the lock path is neither a regular file nor a symlink.
        OSError: any I/O failure (``latest`` is then unchanged).
    """
    if not is_plain_name(name) or "\n" in name:
        raise ValueError(f"latest must name a directory in {root}, not {name!r}")
    with FileLock(_lock_path(root)):
        tmp = root / f".{LATEST_NAME}.tmp-{secrets.token_hex(8)}"
        try:
            write_new_file(tmp, (name + "\n").encode())
            os.replace(tmp, root / LATEST_NAME)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_directory(root)


#: ``latest`` holds one directory name; a larger file is not ours.
_LATEST_MAX_BYTES = 4096


def read_latest(root: Path) -> str | None:
    """The checkpoint directory name ``root/latest`` points at, or ``None``.

    ``None`` also when ``latest`` is a symlink (never followed), not a regular file,
    larger than 4096 bytes, not UTF-8, or not a plain file name.
    """
    try:
        fd = open_no_follow(root / LATEST_NAME)
    except (OSError, CorruptCheckpointError):
        return None
    try:
        with open(fd, "rb") as f:
            data = f.read(_LATEST_MAX_BYTES + 1)
        name = data.decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if len(data) > _LATEST_MAX_BYTES or not is_plain_name(name):
        return None
    return name
