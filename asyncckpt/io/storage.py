"""The storage seam: where a checkpoint's bytes go and come from (a tier).

A tier is one object that implements :class:`Storage`, in the spirit of
``torch.distributed.checkpoint``'s ``StorageWriter`` / ``StorageReader``: the save
path and the load path call it, and never touch files themselves, so that a new tier
(a node-local tier replicated to peers, an object store) is a new implementation, not
new branches in the save path. :class:`LocalStorage` is the local file system, the
only tier today (:data:`LOCAL`).

Collective contract of a save (one ``Storage`` object, the same on every rank; which
rank calls what, in this order):

0. (all ranks, training thread) :meth:`Storage.temporary_dir`: where this save's
   files go until the commit. No I/O; every rank computes the same name.
1. (all ranks, the background worker or a forked child)
   :meth:`Storage.write_rank`: write this rank's staged files, durably. Runs without
   torch: the ``Storage`` object is pickled to the worker with the call, so it must be
   picklable and its module must not import torch.
2. (coordinator only, after every rank's step 1 succeeded, in the finalizer thread)
   :meth:`Storage.commit`: write ``.metadata``, ``.records.json`` and the manifest,
   and make the checkpoint visible atomically: a reader sees all of it or nothing.
3. (coordinator only, instead of 2, once it decided not to commit)
   :meth:`Storage.discard`: remove what steps 0-1 left. Never called on the other ranks:
   they must not remove what the coordinator may still be committing.

Collective contract of a load: none. Every rank calls the read side
(:class:`ReadableStorage`: :meth:`~ReadableStorage.read_manifest`,
:meth:`~ReadableStorage.verify`, :meth:`~ReadableStorage.exists`,
:meth:`~ReadableStorage.open_checkpoint`) on its own; the loaders
(``asyncckpt.loading``) agree across ranks through their own collectives. A loader
reads a file through a :class:`FileReader`: its ``size`` and ``readinto(offset,
buffers)``, the bytes at ``offset`` into the given buffers in order (the local tier:
``os.preadv`` on a descriptor, :class:`LocalFileReader`; the object store: ranged GETs
streamed into the buffers, :class:`asyncckpt.io.s3.S3Checkpoint`). The loaders check
the manifest's CRC-32s on the bytes as they land, whatever the tier.

A tier that keeps a root of steps also offers a :class:`StepIndex`: the committed
steps, their commit order, ``latest``, and the removal of a step (retention). The
local root's is :class:`LocalStepIndex` (a thin reader of a root directory;
:class:`asyncckpt.root.CheckpointRoot` adds the lock, leftovers and retention policy),
the object store's :class:`asyncckpt.io.s3.S3Tier` (a commit marker per step).

Torch-free.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from asyncckpt import _fs
from asyncckpt.errors import AsyncckptError, CorruptCheckpointError
from asyncckpt.format import manifest as _manifest
from asyncckpt.format.naming import parse_step_dir, step_dir_name
from asyncckpt.io import commit as _commit
from asyncckpt.io import writer as _writer
from asyncckpt.io.writer import FileResult, RankWriteResult, WriteTask

__all__ = [
    "Storage",
    "ReadableStorage",
    "CheckpointReader",
    "FileReader",
    "LocalStorage",
    "LocalCheckpointReader",
    "LocalFileReader",
    "LOCAL",
    "StepIndex",
    "LocalStepIndex",
    "preadv_all",
    "pread_into",
]

#: ``preadv`` takes at most this many buffers per call (Linux ``IOV_MAX``).
IOV_MAX = 1024


class FileReader(Protocol):
    """One file of a checkpoint, open for positioned reads.

    Attributes:
        path: the file's path or URL (for messages).
        size: its size in bytes.
        batch_bytes: how many bytes one :meth:`readinto` call should ask for to keep
            this tier busy (an object store: a part per GET in flight); ``0``: the
            loader's own default (the local disk: 64 MiB calls).
    """

    path: str
    size: int
    batch_bytes: int

    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` (writable byte views), in order, with the file's bytes from
        ``offset`` (``offset + sum(len(b))`` at most :attr:`size`).

        Raises:
            CorruptCheckpointError: the file ends first, or (a remote tier) the bytes
                belong to another save or another size than the manifest's.
            CheckpointNotFoundError: (a remote tier) the file was removed meanwhile.
            RemoteStorageError: (a remote tier) a request failed after the client's retries.
        """
        ...

    def close(self) -> None:
        """Release the file (idempotent)."""
        ...


class CheckpointReader(Protocol):
    """A committed checkpoint open for reading (:meth:`ReadableStorage.open_checkpoint`);
    a context manager that closes it."""

    root: str

    def open(self, name: str) -> FileReader:
        """The regular file ``name`` (a plain file name) of the checkpoint.

        Raises:
            CorruptCheckpointError: missing, a symlink, not a regular file, unreadable.
        """
        ...

    def file_size(self, name: str) -> int | None:
        """The size in bytes of the regular file ``name``, ``None`` when it is missing.

        Raises:
            CorruptCheckpointError: a symlink or not a regular file.
        """
        ...

    def read_bytes(self, name: str) -> bytes:
        """The whole (small) file ``name``: ``.metadata``, ``.records.json``.

        Raises:
            CorruptCheckpointError: see :meth:`open`.
        """
        ...

    def close(self) -> None: ...

    def __enter__(self) -> CheckpointReader: ...

    def __exit__(self, *exc: object) -> None: ...


class ReadableStorage(Protocol):
    """The read side of a tier: what the loaders need from it (see the module
    docstring). No collective."""

    def read_manifest(self, checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
        """A committed checkpoint's manifest, sanity-checked.

        Raises:
            CorruptCheckpointError: missing, unreadable or malformed.
        """
        ...

    def verify(
        self,
        checkpoint_dir: str | os.PathLike,
        names: Iterable[str] | None = None,
        on_bytes: Callable[[int], None] | None = None,
        threads: int | None = None,
    ) -> dict[str, Any]:
        """Check a checkpoint's files (``names``: only those) against its manifest's
        sizes and CRC-32s; ``on_bytes(n)`` after each ``n`` bytes checked.

        Returns:
            The manifest.

        Raises:
            CorruptCheckpointError: naming the first bad file.
        """
        ...

    def exists(self, checkpoint_dir: str | os.PathLike, name: str) -> bool:
        """Whether the checkpoint holds an entry ``name`` (of any type; never followed)."""
        ...

    def open_checkpoint(self, checkpoint_dir: str) -> CheckpointReader:
        """The checkpoint, open for reading its files (the caller closes it).

        Raises:
            CorruptCheckpointError: there is no such checkpoint.
        """
        ...


class Storage(ReadableStorage, Protocol):
    """A checkpoint tier: the write of a rank's files, the commit, the discard of a
    failed save, and the reads of a committed checkpoint. See the module docstring for
    which rank calls what."""

    # ------------------------------------------------------------------ save side
    def temporary_dir(self, final_dir: Path, token: str) -> Path:
        """(all ranks) Where the files of the save ``token`` into ``final_dir`` are
        written until the commit. Pure: no I/O, the same on every rank."""
        ...

    def write_rank(self, task: WriteTask) -> RankWriteResult:
        """(all ranks, in the torch-free worker) Write one rank's staged files into
        ``task.directory`` (a :meth:`temporary_dir`) and make them durable.

        Returns:
            The files' sizes and checksummed segments, for the manifest.

        Raises:
            OSError: any I/O failure (the files this call created are removed).
        """
        ...

    def commit(
        self,
        tmp_dir: Path,
        final_dir: Path,
        metadata_bytes: bytes,
        files: Iterable[FileResult],
        info: dict[str, Any],
        small: Mapping[str, bytes] | None = None,
    ) -> dict[str, Any]:
        """(coordinator only) Commit the save whose files every rank wrote into
        ``tmp_dir``: it becomes visible as ``final_dir``, atomically.

        Args:
            tmp_dir: the save's :meth:`temporary_dir`.
            final_dir: the committed name; must not exist, or be an empty directory.
            metadata_bytes: the pickled DCP ``Metadata`` (``.metadata``).
            files: every rank's written files.
            info: extra manifest fields (``world_size``, ``step``, ``save_token``, ...).
            small: the small files beside ``.metadata`` (name -> bytes: the records
                file, or the shard index and its chunk lines), or ``None``: none.

        Returns:
            The manifest.

        Raises:
            FileExistsError: ``final_dir`` exists and is not empty.
            CorruptCheckpointError: a file of ``files`` is missing or of another size.
            OSError: any I/O failure; nothing is then committed.
        """
        ...

    def discard(self, tmp_dir: Path) -> None:
        """(coordinator only) Remove a save's :meth:`temporary_dir` that will never be
        committed. Never raises; no error if nothing is there."""
        ...

    # ------------------------------------------------------------------ read side (descriptors)
    def open_dir(self, checkpoint_dir: str) -> int:
        """A descriptor of the checkpoint, for :meth:`open_file` (the caller closes it).

        Raises:
            CorruptCheckpointError: there is no such checkpoint.
        """
        ...

    def open_file(self, dir_fd: int, checkpoint_dir: str, name: str) -> int:
        """A read-only descriptor of the regular file ``name`` of the checkpoint opened
        as ``dir_fd`` (the caller closes it); never through a symlink.

        Raises:
            CorruptCheckpointError: missing, a symlink, not a regular file, unreadable.
        """
        ...


@dataclass(frozen=True)
class LocalStorage:
    """The local (or shared, POSIX) file system: a checkpoint is a directory.

    The save's files go into a hidden ``.<name>.tmp-<token>`` directory beside the
    final name (:func:`asyncckpt.io.commit.temporary_dir_for`), written by
    :func:`asyncckpt.io.writer.write_rank_files`; the commit
    (:func:`asyncckpt.io.commit.commit_directory`) writes the small files, fsyncs, and
    renames the directory (the commit point); a discard renames it to a hidden
    ``.deleting-`` name and removes it. Reads open files relative to a descriptor of
    the directory with ``O_NOFOLLOW``. Stateless: picklable, equal to any other.
    """

    def temporary_dir(self, final_dir: Path, token: str) -> Path:
        return _commit.temporary_dir_for(final_dir, token)

    def write_rank(self, task: WriteTask) -> RankWriteResult:
        return _writer.write_rank_files(task)

    def commit(
        self,
        tmp_dir: Path,
        final_dir: Path,
        metadata_bytes: bytes,
        files: Iterable[FileResult],
        info: dict[str, Any],
        small: Mapping[str, bytes] | None = None,
    ) -> dict[str, Any]:
        return _commit.commit_directory(tmp_dir, final_dir, metadata_bytes, files, info, small)

    def discard(self, tmp_dir: Path) -> None:
        _fs.remove_checkpoint(tmp_dir, best_effort=True)

    def read_manifest(self, checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
        return _manifest.read_manifest(checkpoint_dir)

    def verify(
        self,
        checkpoint_dir: str | os.PathLike,
        names: Iterable[str] | None = None,
        on_bytes: Callable[[int], None] | None = None,
        threads: int | None = None,
    ) -> dict[str, Any]:
        return _manifest.verify_checkpoint(checkpoint_dir, names, on_bytes, threads)

    def exists(self, checkpoint_dir: str | os.PathLike, name: str) -> bool:
        return os.path.lexists(os.path.join(checkpoint_dir, name))

    def open_dir(self, checkpoint_dir: str) -> int:
        return _fs.open_dir(checkpoint_dir)

    def open_file(self, dir_fd: int, checkpoint_dir: str, name: str) -> int:
        return _fs.open_member(dir_fd, checkpoint_dir, name)

    def open_checkpoint(self, checkpoint_dir: str) -> LocalCheckpointReader:
        return LocalCheckpointReader(checkpoint_dir)


def preadv_all(fd: int, views: Sequence[memoryview], offset: int, path: str) -> None:
    """Fill ``views`` (in order) from ``fd`` at ``offset``: at most :data:`IOV_MAX`
    buffers per ``os.preadv``, short reads finished.

    Raises:
        CorruptCheckpointError: the file ``path`` ends first.
    """
    i, pos = 0, offset
    while i < len(views):
        batch = views[i : i + IOV_MAX]
        want = sum(len(v) for v in batch)
        got = os.preadv(fd, batch, pos) if want else 0
        if got < want:  # short (rare): finish the batch buffer by buffer
            done = 0
            for v in batch:
                if done + len(v) > got:
                    lo = max(0, got - done)
                    pread_into(fd, v[lo:], pos + done + lo, path)
                done += len(v)
        pos += want
        i += IOV_MAX


def pread_into(fd: int, buf: memoryview, offset: int, path: str) -> None:
    """Fill ``buf`` from ``fd`` at ``offset`` (short reads finished).

    Raises:
        CorruptCheckpointError: the file ``path`` ends first.
    """
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(f"{path} is truncated (a record ends past the end of the file)", path)
        done += n


class LocalFileReader:
    """:class:`FileReader` of a local file: ``os.preadv`` on the descriptor ``fd``
    (owned: :meth:`close` closes it), one call per up to :data:`IOV_MAX` buffers."""

    __slots__ = ("fd", "path", "size")
    batch_bytes = 0

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path, self.size = fd, path, os.fstat(fd).st_size

    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None:
        preadv_all(self.fd, buffers, offset, self.path)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class LocalCheckpointReader:
    """:class:`CheckpointReader` of a local checkpoint directory: files opened relative
    to a descriptor of the directory with ``O_NOFOLLOW`` (:func:`asyncckpt._fs.open_member`).

    Raises:
        CorruptCheckpointError: (on creation) there is no such directory.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.dir_fd = _fs.open_dir(root)

    def open(self, name: str) -> LocalFileReader:
        return LocalFileReader(_fs.open_member(self.dir_fd, self.root, name), os.path.join(self.root, name))

    def file_size(self, name: str) -> int | None:
        path = os.path.join(self.root, name)
        try:
            st = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            raise CorruptCheckpointError(f"{path} is a symlink; checkpoint files must be regular files", path)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{path} is not a regular file", path)
        real_root = os.path.realpath(self.root)
        if os.path.dirname(os.path.realpath(os.path.join(real_root, name))) != real_root:
            raise CorruptCheckpointError(f"{path} resolves outside the checkpoint directory", path)
        return st.st_size

    def read_bytes(self, name: str) -> bytes:
        fd = _fs.open_member(self.dir_fd, self.root, name)
        try:
            with open(fd, "rb", closefd=False) as f:
                return f.read()
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.dir_fd >= 0:
            fd, self.dir_fd = self.dir_fd, -1
            os.close(fd)

    def __enter__(self) -> LocalCheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: The local file system tier (the default everywhere).
LOCAL: Storage = LocalStorage()


class StepIndex(Protocol):
    """The steps a tier holds under one root (a local directory, an ``s3://`` prefix),
    beyond a checkpoint's writes and reads: listing, ``latest``, removal (retention).
    Step names are :mod:`asyncckpt.format.naming`'s. No collective; any rank."""

    def steps(self) -> list[int]:
        """The committed steps, ascending (a step without its commit point is absent)."""
        ...

    def commit_order(self) -> list[int]:
        """The committed steps, the oldest commit first (the newest save last)."""
        ...

    def read_latest(self) -> int | None:
        """The step ``latest`` names, or ``None`` (missing, or not a step's name). A
        hint written after the commit point: it can lag, never lead."""
        ...

    def write_latest(self, step: int) -> None:
        """Name ``step`` in ``latest``, atomically."""
        ...

    def remove_step(self, step: int) -> None:
        """Remove step ``step``: first its commit point (so that it is absent at once),
        then its data; no error if it is absent."""
        ...


@dataclass(frozen=True)
class LocalStepIndex:
    """:class:`StepIndex` of a local root directory: ``step_%08d`` directories with a
    manifest, ordered by their manifests' ``commit_seq``; ``latest`` through
    :func:`asyncckpt.io.commit.write_latest`; removal through a hidden ``.deleting-``
    name (:func:`asyncckpt._fs.remove_checkpoint`)."""

    root: Path

    def _committed(self) -> list[tuple[int, int]]:
        found = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        for entry in entries:
            step = parse_step_dir(entry.name)
            if step is None or not entry.is_dir(follow_symlinks=False) or not _manifest.is_committed(Path(entry.path)):
                continue
            try:
                seq = _manifest.read_manifest(entry.path).get("commit_seq", 0)
            except AsyncckptError:
                seq = 0
            found.append((seq if isinstance(seq, int) and not isinstance(seq, bool) else 0, step))
        return sorted(found)

    def steps(self) -> list[int]:
        return sorted(step for _, step in self._committed())

    def commit_order(self) -> list[int]:
        return [step for _, step in self._committed()]

    def read_latest(self) -> int | None:
        name = _commit.read_latest(Path(self.root))
        return None if name is None else parse_step_dir(name)

    def write_latest(self, step: int) -> None:
        _commit.write_latest(Path(self.root), step_dir_name(step))

    def remove_step(self, step: int) -> None:
        path = Path(self.root) / step_dir_name(step)
        if os.path.lexists(path):
            _fs.remove_checkpoint(path)
