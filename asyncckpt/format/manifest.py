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

import errno
import json
import os
import secrets
import shutil
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

from filelock import FileLock

from asyncckpt import _faults
from asyncckpt.errors import CheckpointError, CorruptCheckpointError
from asyncckpt.format.crc import CrcChain, crc32
from asyncckpt.io.writer import FileResult, fsync_directory

__all__ = [
    "METADATA_NAME",
    "MANIFEST_NAME",
    "LATEST_NAME",
    "temporary_dir_for",
    "commit_directory",
    "discard_temporary",
    "read_manifest",
    "verify_checkpoint",
    "is_committed",
    "write_latest",
    "read_latest",
    "remove_checkpoint",
]

METADATA_NAME = ".metadata"
MANIFEST_NAME = ".manifest.json"
#: An index of the records for ``load``'s direct path (:mod:`asyncckpt.format.records`).
RECORDS_NAME = ".records.json"
LATEST_NAME = "latest"
LOCK_NAME = ".asyncckpt.lock"
MANIFEST_FORMAT = "asyncckpt.manifest"
MANIFEST_VERSION = 1
_READ_CHUNK = 8 << 20
#: Read buffers per file being checked (one is read into while the others are checksummed).
_RING = 3


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
    records: bytes | None = None,
) -> dict[str, Any]:
    """Write metadata, records and manifest into ``tmp_dir`` and rename it to ``final_dir``.

    Args:
        tmp_dir: the temporary directory holding every rank's data files (durable).
        final_dir: the committed name; must not exist, or be an empty directory.
        metadata_bytes: the pickled ``torch.distributed.checkpoint.metadata.Metadata``.
        files: every rank's written files.
        info: extra fields for the manifest (world_size, step, ...).
        records: the records file's bytes (:func:`asyncckpt.format.records.records_file`
            of ``metadata_bytes``), written as :data:`RECORDS_NAME`; ``None``: none.

    Returns:
        The manifest.

    Raises:
        FileExistsError: ``final_dir`` exists and is not empty.
        CorruptCheckpointError: a file of ``files`` is missing from ``tmp_dir`` or has
            another size (checked just before the rename): nothing is committed.
        OSError: any I/O failure; ``final_dir`` is then not created.
    """
    files = list(files)
    entries = {f.name: {"size": f.nbytes, "segments": [list(s) for s in f.segments]} for f in files}
    small = {METADATA_NAME: metadata_bytes}
    if records is not None:
        small[RECORDS_NAME] = records
    for name, data in small.items():
        _write_new_file(tmp_dir / name, data)
        entries[name] = {"size": len(data), "segments": [[0, len(data), crc32(data)]]}
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
    _check_present(tmp_dir, final_dir, files)
    if final_dir.exists() and any(final_dir.iterdir()):
        raise FileExistsError(f"{final_dir} exists and is not empty; it is never overwritten")
    os.rename(tmp_dir, final_dir)  # atomic; replaces an empty directory
    fsync_directory(str(final_dir.parent))
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
                str(path)) from None
        if not stat.S_ISREG(st.st_mode) or st.st_size != f.nbytes:
            raise CorruptCheckpointError(
                f"{f.name} in {tmp_dir} has {st.st_size} bytes, its writer wrote {f.nbytes}; "
                f"{final_dir} is not committed", str(path))


def discard_temporary(tmp_dir: Path) -> None:
    """Remove a save's temporary directory that will never be committed: first renamed
    to a hidden ``.deleting-`` name (so whoever waits for the coordinator's decision sees
    the temporary name go at once), then removed. No error if it is gone already."""
    base = tmp_dir.name.rsplit(".tmp-", 1)[0]
    doomed = tmp_dir.parent / f"{base}.deleting-{secrets.token_hex(6)}"
    try:
        os.rename(tmp_dir, doomed)
    except FileNotFoundError:
        return
    except OSError:
        doomed = tmp_dir
    shutil.rmtree(doomed, ignore_errors=True)


def _open_no_follow(path: Path) -> int:
    """Open the regular file ``path`` for reading, never through a symlink.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CorruptCheckpointError: ``path`` is a symlink or not a regular file.
        OSError: any other failure.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptCheckpointError(f"{path} is a symlink; checkpoint files must be regular files",
                                         str(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{path} is not a regular file", str(path))
    return fd


def is_plain_name(name: Any) -> bool:
    """True for a non-empty ``str`` naming an entry of a directory and nothing else: no
    ``/``, ``\\`` or NUL, not ``.``/``..``, not absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\x00" not in name and os.sep not in name and not os.path.isabs(name)
            and (os.altsep is None or os.altsep not in name))


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_manifest(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """Read and sanity-check a checkpoint's manifest (no symlink is followed).

    Every file name must be a plain name inside the directory (no ``/``, ``\\`` or
    NUL, not ``.``/``..``, not absolute), every entry a ``size`` in bytes and
    ``segments`` of ``[offset, length, crc32]`` non-negative integers.

    Raises:
        CorruptCheckpointError: missing, a symlink, unreadable, malformed, or naming
            a path outside the checkpoint directory.
    """
    path = Path(checkpoint_dir) / MANIFEST_NAME
    try:
        fd = _open_no_follow(path)
        with open(fd, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: {checkpoint_dir} is not a committed checkpoint",
                                     str(path)) from None
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path} cannot be read: {exc}", str(path)) from exc
    if (not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT
            or not isinstance(manifest.get("files"), dict)):
        raise CorruptCheckpointError(f"{path} is not an asyncckpt manifest", str(path))
    for name, entry in manifest["files"].items():
        if not is_plain_name(name):
            raise CorruptCheckpointError(f"{path} names a file outside the checkpoint: {name!r}", str(path))
        segments = entry.get("segments") if isinstance(entry, dict) else None
        if (not _is_uint(entry.get("size") if isinstance(entry, dict) else None) or not isinstance(segments, list)
                or not all(isinstance(seg, list) and len(seg) == 3 and all(_is_uint(v) for v in seg)
                           for seg in segments)):
            raise CorruptCheckpointError(f"{path}: malformed entry for {name!r}", str(path))
    return manifest


def is_committed(checkpoint_dir: Path) -> bool:
    """True if ``checkpoint_dir`` is a directory with a manifest and DCP metadata."""
    return (checkpoint_dir / MANIFEST_NAME).is_file() and (checkpoint_dir / METADATA_NAME).is_file()


def verify_checkpoint(checkpoint_dir: str | os.PathLike, names: Iterable[str] | None = None,
                      on_bytes: Callable[[int], None] | None = None, threads: int | None = None) -> dict[str, Any]:
    """Check sizes and CRC-32 checksums of a checkpoint's files against its manifest.

    Each file is read sequentially by one thread (files in parallel) into a few
    reused buffers (no allocation, no page fault per chunk) while a helper thread
    computes the CRC-32 of what was read (``crc32`` and ``preadv`` release the
    GIL). The error reported is that of the first bad file in
    ``names`` order and, within it, the first bad segment, whatever the threads'
    timing.

    Args:
        checkpoint_dir: the committed checkpoint directory.
        names: check only these files (default: all files of the manifest).
        on_bytes: called with the number of bytes just checked (progress bars);
            calls are serialized.
        threads: checking threads (default: up to 4, at most the CPU count).

    Returns:
        The manifest.

    Raises:
        CorruptCheckpointError: naming the first file that is missing, has the wrong
            size, is a symlink, or whose bytes do not match a checksum.
    """
    root = Path(checkpoint_dir)
    manifest = read_manifest(root)
    files = manifest["files"]
    fds: list[int] = []
    # (file order, segment order, fd, path, offset, length, crc) of every segment
    work: list[tuple[int, int, int, Path, int, int, int]] = []
    try:
        for order, name in enumerate(sorted(files) if names is None else names):
            entry = files.get(name)
            path = root / name
            if entry is None:
                raise CorruptCheckpointError(f"{path} is not listed in the manifest", str(path))
            try:
                fd = _open_no_follow(path)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{path} is missing (listed in the manifest)", str(path)) from None
            except OSError as exc:
                raise CorruptCheckpointError(f"{path} cannot be read: {exc}", str(path)) from exc
            fds.append(fd)
            size = os.fstat(fd).st_size
            if size != entry["size"]:
                raise CorruptCheckpointError(
                    f"{path} has {size} bytes, the manifest says {entry['size']}", str(path))
            expected_pos = 0
            for k, (offset, length, crc) in enumerate(entry["segments"]):
                if offset != expected_pos:
                    raise CorruptCheckpointError(f"{path}: manifest segments do not cover the file", str(path))
                work.append((order, k, fd, path, offset, length, crc))
                expected_pos = offset + length
            if expected_pos != entry["size"]:
                raise CorruptCheckpointError(f"{path}: manifest segments do not cover the file", str(path))
        _check_segments(work, on_bytes, threads)
    finally:
        for fd in fds:
            os.close(fd)
    return manifest


def run_in_order(work: list, fn: Callable[[Any], None], threads: int, name: str) -> None:
    """Run ``fn(item)`` for each item of ``work`` (items start with their order key) on
    up to ``threads`` threads; raise the exception of the first failing item in order.

    Items after one that failed already are skipped; with one thread, the first
    failure stops the loop. Shared by verification and the direct load.
    """
    lock = threading.Lock()
    errors: list[tuple[Any, BaseException]] = []

    def one(item: Any) -> None:
        if errors and min(e[0] for e in errors) < item[0]:
            return  # an earlier item already failed
        try:
            fn(item)
        except BaseException as exc:  # noqa: BLE001 - the first in order is raised
            with lock:
                errors.append((item[0], exc))

    if threads <= 1 or len(work) <= 1:
        for item in work:
            one(item)
            if errors:
                break
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix=name) as pool:
            list(pool.map(one, work))
    if errors:
        raise min(errors, key=lambda e: e[0])[1]


def _check_segments(work: list, on_bytes: Callable[[int], None] | None, threads: int | None) -> None:
    """CRC-check segments; raise the error of the first bad one (in file, then segment
    order).

    Each file is read sequentially by one thread (files in parallel, up to ``threads``),
    into a ring of :data:`_RING` reused buffers of ``_READ_CHUNK`` bytes, and each
    chunk's CRC-32 is computed on a helper thread while the next is read
    (:class:`~asyncckpt.format.crc.CrcChain`): on the disk measured here one reader
    per file is faster than several at different offsets (see
    ``reader._read_file``)."""
    lock = threading.Lock()
    by_file: dict[int, list] = {}
    for item in work:
        by_file.setdefault(item[0], []).append(item)

    def check_file(task: tuple) -> None:
        _, segments = task

        def bad(segment: tuple, actual: int) -> CorruptCheckpointError:
            path, offset, length, expected = segment
            return CorruptCheckpointError(
                f"{path}: checksum mismatch in bytes [{offset}, {offset + length}) "
                f"(crc32 {actual:08x}, manifest {expected:08x})", str(path))

        # No larger than the file's bytes: a 3 x 8 MiB ring costs 13 ms to allocate,
        # more than checking a small .metadata file.
        chunk = min(_READ_CHUNK, max(1, sum(seg[5] for seg in segments)))
        ring = [memoryview(bytearray(chunk)) for _ in range(_RING)]
        pending: list[Any] = [None] * _RING
        turn = 0
        with CrcChain() as chain:
            for _, _, fd, path, offset, length, crc in segments:
                pos, end = offset, offset + length
                while pos < end:
                    if pending[turn] is not None:
                        pending[turn].result()  # the helper is done with this buffer
                    buf = ring[turn]
                    n = os.preadv(fd, [buf[:min(end - pos, chunk)]], pos)
                    if n <= 0:
                        raise CorruptCheckpointError(f"{path} is truncated", str(path))
                    pending[turn] = chain.update([buf[:n]])
                    turn = (turn + 1) % _RING
                    pos += n
                    if on_bytes is not None:
                        with lock:
                            on_bytes(n)
                chain.end((path, offset, length, crc), crc)
                chain.raise_mismatch(bad)
            chain.raise_mismatch(bad, final=True)

    run_in_order(sorted(by_file.items()), check_file,
                 min(4, os.cpu_count() or 1) if threads is None else threads, "asyncckpt-verify")


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
            _write_new_file(tmp, (name + "\n").encode())
            os.replace(tmp, root / LATEST_NAME)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_directory(str(root))


#: ``latest`` holds one directory name; a larger file is not ours.
_LATEST_MAX_BYTES = 4096


def read_latest(root: Path) -> str | None:
    """The checkpoint directory name ``root/latest`` points at, or ``None``.

    ``None`` also when ``latest`` is a symlink (never followed), not a regular file,
    larger than 4096 bytes, not UTF-8, or not a plain file name.
    """
    try:
        fd = _open_no_follow(root / LATEST_NAME)
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


def remove_checkpoint(path: Path, background: bool = False) -> threading.Thread | None:
    """Delete a checkpoint directory: first renamed to a hidden name (so a crash
    mid-delete never leaves a partial directory under a committed name), then removed.

    Args:
        path: the checkpoint directory.
        background: remove the renamed directory in a daemon thread (returned) so
            that the caller (the training thread, in a commit) does not wait for the
            unlinks; a removal cut short by exit leaves a hidden ``.deleting-`` name
            that ``CheckpointManager`` and ``asyncckpt clean`` remove later.
    """
    doomed = path.parent / f".{path.name}.deleting-{secrets.token_hex(6)}"
    os.rename(path, doomed)
    fsync_directory(str(path.parent))
    if not background:
        shutil.rmtree(doomed, ignore_errors=True)
        return None
    thread = threading.Thread(target=shutil.rmtree, args=(doomed,), kwargs={"ignore_errors": True},
                              name=f"asyncckpt-retention:{doomed.name}", daemon=True)
    thread.start()
    return thread
