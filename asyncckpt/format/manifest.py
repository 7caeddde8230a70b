"""The manifest: file names of a checkpoint, the manifest's format, and verification.

A committed checkpoint directory holds the data files, ``.metadata`` (the DCP
metadata), optionally ``.records.json`` (:mod:`asyncckpt.format.records`) and
``.manifest.json``: per-file sizes and CRC-32 checksummed segments, plus what the save
recorded (world size, step, save token, commit sequence number). The commit that
writes it is :mod:`asyncckpt.io.commit`; :func:`verify_checkpoint` checks a checkpoint
against it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from asyncckpt._fs import open_no_follow
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.crc import CrcChain, crc32

__all__ = [
    "METADATA_NAME",
    "MANIFEST_NAME",
    "RECORDS_NAME",
    "SHARDS_NAME",
    "CHUNKS_NAME",
    "LATEST_NAME",
    "LOCK_NAME",
    "is_plain_name",
    "build_manifest",
    "manifest_bytes",
    "read_manifest",
    "verify_checkpoint",
    "step_metadata",
    "is_committed",
    "run_in_order",
]

METADATA_NAME = ".metadata"
MANIFEST_NAME = ".manifest.json"
#: An index of the records for ``load``'s direct path (:mod:`asyncckpt.format.records`).
RECORDS_NAME = ".records.json"
#: The shard index of a sharded checkpoint, and its chunk lines (:mod:`asyncckpt.format.shards`).
SHARDS_NAME = ".shards.json"
CHUNKS_NAME = ".shards.chunks.jsonl"
LATEST_NAME = "latest"
LOCK_NAME = ".asyncckpt.lock"
MANIFEST_FORMAT = "asyncckpt.manifest"
MANIFEST_VERSION = 1
_READ_CHUNK = 8 << 20
#: Read buffers per file being checked (one is read into while the others are checksummed).
_RING = 3


def build_manifest(files: Iterable[Any], small: Mapping[str, bytes], info: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest of a checkpoint being committed.

    Args:
        files: every rank's data files, each with ``name``, ``nbytes`` and ``segments``
            (``(offset, length, crc32)`` triples: ``asyncckpt.io.writer.FileResult``).
        small: the files the commit writes itself (``.metadata``, ``.records.json``) by
            name: their bytes, one segment each.
        info: extra fields (``world_size``, ``step``, ``save_token``, ...).

    Returns:
        The manifest (a JSON-able dict, files sorted by name).
    """
    entries = {f.name: {"size": f.nbytes, "segments": [list(s) for s in f.segments]} for f in files}
    for name, data in small.items():
        entries[name] = {"size": len(data), "segments": [[0, len(data), crc32(data)]]}
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "checksum": "crc32",
        "created_unix_s": time.time(),
        "total_bytes": sum(e["size"] for e in entries.values()),
        **info,
        "files": dict(sorted(entries.items())),
    }


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    """The bytes of ``.manifest.json`` for ``manifest``."""
    return json.dumps(manifest, indent=1).encode()


def is_plain_name(name: Any) -> bool:
    """True for a non-empty ``str`` naming an entry of a directory and nothing else: no
    ``/``, ``\\`` or NUL, not ``.``/``..``, not absolute."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
        and os.sep not in name
        and not os.path.isabs(name)
        and (os.altsep is None or os.altsep not in name)
    )


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
        fd = open_no_follow(path)
        with open(fd, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path} is missing: {checkpoint_dir} is not a committed checkpoint", str(path)
        ) from None
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path} cannot be read: {exc}", str(path)) from exc
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != MANIFEST_FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise CorruptCheckpointError(f"{path} is not an asyncckpt manifest", str(path))
    version = manifest.get("version", MANIFEST_VERSION)
    if not (isinstance(version, int) and not isinstance(version, bool) and 0 <= version <= MANIFEST_VERSION):
        raise CorruptCheckpointError(
            f"{path} is of manifest format version {version!r}, and this asyncckpt reads versions up to "
            f"{MANIFEST_VERSION}: written by a newer asyncckpt "
            f"({manifest.get('asyncckpt_version', 'version unknown')}); upgrade asyncckpt to read it",
            str(path),
        )
    for name, entry in manifest["files"].items():
        if not is_plain_name(name):
            raise CorruptCheckpointError(f"{path} names a file outside the checkpoint: {name!r}", str(path))
        segments = entry.get("segments") if isinstance(entry, dict) else None
        if (
            not _is_uint(entry.get("size") if isinstance(entry, dict) else None)
            or not isinstance(segments, list)
            or not all(isinstance(seg, list) and len(seg) == 3 and all(_is_uint(v) for v in seg) for seg in segments)
        ):
            raise CorruptCheckpointError(f"{path}: malformed entry for {name!r}", str(path))
    return manifest


def step_metadata(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint was saved with, from its manifest (no tensor is read).

    Returns:
        ``step`` (or ``None``), ``metrics`` (``{name: float}``, ``{}`` when none),
        ``metadata`` (the user's dict, ``{}`` when none), ``asyncckpt_version`` (the
        library that wrote it, ``None`` before it was recorded), ``format_version``
        (the manifest's), ``world_size``, ``total_bytes``, ``created_unix_s`` (the
        commit's time, seconds since the epoch) and ``commit_seq`` (``None`` when
        absent).
    """
    metrics = manifest.get("metrics")
    metadata = manifest.get("metadata")
    return {
        "step": manifest.get("step"),
        "metrics": dict(metrics) if isinstance(metrics, dict) else {},
        "metadata": dict(metadata) if isinstance(metadata, dict) else {},
        "asyncckpt_version": manifest.get("asyncckpt_version"),
        "format_version": manifest.get("version"),
        "world_size": manifest.get("world_size"),
        "total_bytes": manifest.get("total_bytes"),
        "created_unix_s": manifest.get("created_unix_s"),
        "commit_seq": manifest.get("commit_seq"),
    }


def is_committed(checkpoint_dir: Path) -> bool:
    """True if ``checkpoint_dir`` is a directory with a manifest and DCP metadata."""
    return (checkpoint_dir / MANIFEST_NAME).is_file() and (checkpoint_dir / METADATA_NAME).is_file()


def verify_checkpoint(
    checkpoint_dir: str | os.PathLike,
    names: Iterable[str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
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
                fd = open_no_follow(path)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{path} is missing (listed in the manifest)", str(path)) from None
            except OSError as exc:
                raise CorruptCheckpointError(f"{path} cannot be read: {exc}", str(path)) from exc
            fds.append(fd)
            size = os.fstat(fd).st_size
            if size != entry["size"]:
                raise CorruptCheckpointError(f"{path} has {size} bytes, the manifest says {entry['size']}", str(path))
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
    (:class:`~asyncckpt.format.crc.CrcChain`): one reader per file keeps the kernel's
    readahead going, where several at different offsets defeat it (see
    :func:`asyncckpt.loading.direct._read_file`)."""
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
                f"(crc32 {actual:08x}, manifest {expected:08x})",
                str(path),
            )

        # No larger than the file's bytes: allocating the full ring would cost more
        # than checking a small .metadata file.
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
                    n = os.preadv(fd, [buf[: min(end - pos, chunk)]], pos)
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

    run_in_order(
        sorted(by_file.items()),
        check_file,
        min(4, os.cpu_count() or 1) if threads is None else threads,
        "asyncckpt-verify",
    )
