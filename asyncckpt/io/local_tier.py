"""The node-local tier: each rank's own shard and its replicas of other ranks' shards.

Policy as data (:class:`LocalTier`, given as ``CheckpointManager(root, local=...)``) and
the files of the tier (:class:`NodeLocalStorage`, a :class:`~asyncckpt.io.storage.Storage`).
The shape follows NVIDIA resiliency-ext's ``LocalCheckpointManager`` (a rank's parts
in a node-local directory, replicated to a clique) and Orbax's emergency
``CheckpointManager`` (local every few steps, persistent rarely); the code is ours.

A node's tier directory holds one directory per shard it stores, whether the shard is
one of its own ranks' or a replica of a rank on another node, and the record of the
job it belongs to (its root) with the lock its ranks hold while they run::

    <dir>/.asyncckpt.owner.json      {"root": "/abs/path/of/the/job's/root"}
    <dir>/.asyncckpt.tier.lock       a shared flock per rank of the job (claim: exclusive)

    <dir>/rank_00002/step_00000010/   a one-rank DCP checkpoint (.metadata, __0_0.distcp,
                                      .records.json, .manifest.json with CRC-32s)
    <dir>/rank_00002/restorable.json  {"step": 10, "world_size": 4, "rank": 2}

A shard's step is written and committed as any checkpoint (a hidden temporary
directory renamed at the commit), by its own rank, or, for a replica, by the rank that
received it. ``restorable.json`` names the newest step that the job decided, together,
is stored on ``replicas + 1`` nodes for every rank (``asyncckpt.replication``); older
steps of the shard are removed then but the newest of them, kept hidden as the shard's
spare (``.spare.tmp-*``): the next step is written into its files, so that a RAM tier
reuses its pages instead of freeing and zeroing them again. A shard thus holds the
restorable step and the spare, or the restorable step and the one in flight.

Torch-free.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncckpt import _fs
from asyncckpt.errors import CorruptCheckpointError, InvalidArgumentError, LocalTierInUseError
from asyncckpt.format import manifest as _manifest
from asyncckpt.format.crc import crc32
from asyncckpt.format.naming import parse_step_dir, step_dir_name
from asyncckpt.io.storage import LocalStorage, preadv_all
from asyncckpt.io.writer import RankWriteResult, WriteTask

__all__ = ["LocalTier", "NodeLocalStorage", "Packed", "Arrival", "RESTORABLE_NAME", "check_segments"]

#: The marker of a shard's newest restorable step.
RESTORABLE_NAME = "restorable.json"


#: The name of a shard's spare directory starts so (a hidden leftover to
#: :meth:`NodeLocalStorage.remove_leftovers`).
_SPARE_PREFIX = ".spare.tmp-"
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_log = logging.getLogger("asyncckpt")
#: :func:`check_segments` with ``fill`` lands and checks this many bytes at a time, so
#: that the CRC reads the bytes the copy has just written, from the cache.
CHECK_CHUNK_BYTES = 2 << 20


# ---------------------------------------------------------------------- the tier's owner
#: The job whose checkpoints a tier directory holds: ``{"root": <its persistent root>}``.
OWNER_NAME = ".asyncckpt.owner.json"
#: Every rank of the job that uses a tier directory holds a shared ``flock`` on this
#: file for its manager's lifetime; the tier changes hands only under an exclusive one.
LOCK_NAME = ".asyncckpt.tier.lock"
#: Seconds a node's first rank waits for the tier's lock (another job's first rank may
#: hold it for the moment of its own claim).
CLAIM_WAIT_S = 2.0


def _entries(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except OSError:
        return []


@dataclass(frozen=True)
class LocalTier:
    """The node-local tier's policy (data, like :class:`~asyncckpt.SaveOptions`).

    Args:
        dir: the node-local directory (RAM-backed ``/dev/shm/...`` or a local NVMe
            path). Every rank of a node passes the same one; it outlives the job, so
            that a restarted job restores from it. It belongs to one job (the one
            whose root it records: :meth:`NodeLocalStorage.claim`): another job
            running there is refused (``LocalTierInUseError``), a new one takes it
            over once the earlier one is gone (its shards are removed).
        every: save to the tier every this many steps (``CheckpointManager.local.save``
            skips the other steps).
        replicas: each rank's shard is also stored on this many other nodes
            (0: local only). The job needs at least ``replicas + 1`` nodes.
        node: this rank's node (default: torchrun's ``GROUP_RANK``, else
            ``rank // LOCAL_WORLD_SIZE``).

    Raises:
        InvalidArgumentError: ``every`` not an int >= 1, ``replicas`` not an int >= 0,
            ``node`` not ``None`` or an int >= 0, ``dir`` not a path.
    """

    dir: str | os.PathLike = "/dev/shm/asyncckpt"
    every: int = 1
    replicas: int = 1
    node: int | None = field(default=None)

    def __post_init__(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not isinstance(self.dir, (str, os.PathLike)) or not os.fspath(self.dir):
            raise InvalidArgumentError(f"LocalTier.dir must be a path, not {self.dir!r}")
        if not is_int(self.every) or self.every < 1:
            raise InvalidArgumentError(f"LocalTier.every must be an int >= 1, not {self.every!r}")
        if not is_int(self.replicas) or self.replicas < 0:
            raise InvalidArgumentError(f"LocalTier.replicas must be an int >= 0, not {self.replicas!r}")
        if self.node is not None and (not is_int(self.node) or self.node < 0):
            raise InvalidArgumentError(f"LocalTier.node must be None or an int >= 0, not {self.node!r}")


@dataclass(frozen=True)
class NodeLocalStorage(LocalStorage):
    """The files of a node's local tier (a :class:`~asyncckpt.io.storage.Storage`).

    The save side and the read side are the local file system's (inherited from
    :class:`~asyncckpt.io.storage.LocalStorage`): a shard's step is a one-rank
    checkpoint directory, committed by a rename. Added: the shard directories, the
    restorable marker, retention, and a replica's arrival (:meth:`receive`: written,
    fsynced, CRC-checked against its manifest, then renamed).
    Picklable (it goes to the torch-free worker with each write).

    Attributes:
        base: the node's tier directory (:attr:`LocalTier.dir`).
    """

    base: Path

    # ------------------------------------------------------------------ the tier's layout
    def shard_dir(self, rank: int) -> Path:
        """The directory of rank ``rank``'s shard on this node."""
        return self.base / f"rank_{rank:05d}"

    def step_dir(self, rank: int, step: int) -> Path:
        """Rank ``rank``'s shard of step ``step`` on this node."""
        return self.shard_dir(rank) / step_dir_name(step)

    def marker(self, rank: int) -> dict[str, int] | None:
        """Rank ``rank``'s restorable marker (``step``, ``world_size``, ``rank``), or
        ``None`` (none, or unreadable)."""
        try:
            data = json.loads(_read_small(self.shard_dir(rank) / RESTORABLE_NAME))
            marker = {k: int(data[k]) for k in ("step", "world_size", "rank")}
        except (OSError, CorruptCheckpointError, ValueError, KeyError, TypeError):
            return None
        return marker if marker["rank"] == rank else None

    def mark_restorable(self, rank: int, step: int, world_size: int) -> None:
        """Record ``step`` as rank ``rank``'s newest restorable step (atomic, durable),
        then remove the shard's older steps (not a save in flight) but the newest of
        them, kept hidden as the spare that the shard's next step is written into
        (:meth:`write_rank` for a rank's own shard, :meth:`arrival` for a replica: its
        memory is written over, not allocated again), in place of one that is there.

        Raises:
            OSError: the marker could not be written.
        """
        shard = self.shard_dir(rank)
        tmp = shard / f".{RESTORABLE_NAME}.tmp-{secrets.token_hex(4)}"
        _fs.write_new_file(tmp, json.dumps({"step": step, "world_size": world_size, "rank": rank}).encode())
        os.replace(tmp, shard / RESTORABLE_NAME)
        _fs.fsync_directory(shard)
        older = sorted(
            (other, entry)
            for entry in shard.iterdir()
            if (other := parse_step_dir(entry.name)) is not None and other != step
        )
        if older and older[-1][0] < step:
            _, newest = older.pop()
            for entry in list(shard.iterdir()):
                if entry.name.startswith(_SPARE_PREFIX):
                    _fs.remove_checkpoint(entry, best_effort=True)
            try:
                os.rename(newest, shard / f"{_SPARE_PREFIX}{secrets.token_hex(4)}")
            except OSError:
                _fs.remove_checkpoint(newest, best_effort=True)
        for _, entry in older:
            _fs.remove_checkpoint(entry, best_effort=True)

    def unmark(self, rank: int) -> None:
        """Remove rank ``rank``'s restorable marker (durably): its shard has none now."""
        (self.shard_dir(rank) / RESTORABLE_NAME).unlink(missing_ok=True)
        _fs.fsync_directory(self.shard_dir(rank))

    def held(self) -> list[tuple[int, int, int]]:
        """The restorable shards on this node: ``(rank, step, world_size)`` for each
        shard whose marked step is committed here (its manifest present; not CRC-checked:
        the restore checks every byte it reads)."""
        found = []
        try:
            entries = sorted(self.base.iterdir())
        except OSError:
            return []
        for entry in entries:
            if not entry.name.startswith("rank_") or not entry.name[5:].isdigit():
                continue
            marker = self.marker(int(entry.name[5:]))
            if marker is not None and _manifest.is_committed(self.step_dir(marker["rank"], marker["step"])):
                found.append((marker["rank"], marker["step"], marker["world_size"]))
        return found

    def remove_leftovers(self, rank: int) -> None:
        """Remove the hidden leftovers of rank ``rank``'s shard (saves or arrivals that
        died: no save of this process is in flight when this is called)."""
        try:
            entries = list(self.shard_dir(rank).iterdir())
        except OSError:
            return
        for entry in entries:
            if entry.name.startswith(".") and (".tmp-" in entry.name or ".deleting-" in entry.name):
                if entry.is_dir() and not entry.is_symlink():
                    _fs.remove_checkpoint(entry, best_effort=True)
                else:
                    entry.unlink(missing_ok=True)

    # ------------------------------------------------------------------ the tier's owner
    def owner(self) -> str | None:
        """The persistent root of the job whose checkpoints the tier holds (``None``:
        none recorded, or unreadable)."""
        try:
            root = json.loads(_read_small(self.base / OWNER_NAME))["root"]
        except (OSError, CorruptCheckpointError, ValueError, KeyError, TypeError):
            return None
        return root if isinstance(root, str) else None

    def claim(self, root: str) -> tuple[int, object]:
        """Make the tier this job's (the job whose persistent root is ``root``), on a
        node's first rank, before any other rank of the node uses it; returns the
        descriptor of the tier's lock, held shared, and its token (:meth:`release`
        them at close).

        With the lock held exclusively (no running job holds the tier): a tier of
        another job, or of no recorded job (made by an asyncckpt before owners), has
        its shards removed (they can never be this job's: restoring them would load
        another model's weights), and this job is recorded as the owner. Without it
        (the ranks of a job hold it): the tier must be this job's already (its own
        earlier processes, still exiting).

        Raises:
            LocalTierInUseError: another job that is running holds the tier.
            OSError: the directory, the lock or the owner record failed.
        """
        self.base.mkdir(parents=True, exist_ok=True)
        return self._lock(root, claim=True)

    def hold(self, root: str) -> tuple[int, object]:
        """The tier's lock, held shared, on a rank of a node whose first rank has
        :meth:`claim` ed it for the job of ``root``, and its token; :meth:`release`
        them at close.

        Raises:
            LocalTierInUseError: the tier is another job's (it was taken over meanwhile).
            OSError: the lock could not be opened.
        """
        return self._lock(root, claim=False)

    def _lock(self, root: str, claim: bool) -> tuple[int, object]:
        # (never blocks, never follows a symlink: a FIFO there would block an ordinary open)
        flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(self.base / LOCK_NAME, flags, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"{self.base / LOCK_NAME} is not a regular file")
            if claim and _flock(fd, fcntl.LOCK_EX, CLAIM_WAIT_S):
                owner = self.owner()
                if owner != root:
                    self._take_over(owner, root)
            # (from exclusive, a conversion that is not atomic: another job's first rank may
            # take the tier between; the owner read under the shared lock, which no claim
            # can change, says who has it)
            if not _flock(fd, fcntl.LOCK_SH, CLAIM_WAIT_S):
                raise self._in_use(None, root)
            self._check_owner(root)
        except BaseException:
            os.close(fd)
            raise
        return fd, _fs.hold_lock_fd(fd)  # (a forked child closes its copy)

    @staticmethod
    def release(fd: int, token: object) -> None:
        """Let go of the tier's lock (:meth:`claim`, :meth:`hold`: their descriptor and
        token); once, never a later lock opened under the same number."""
        _fs.release_lock_fd(fd, token)

    def _check_owner(self, root: str) -> None:
        """(the lock held: the owner cannot change) The tier is ``root`` 's job's.

        Raises:
            LocalTierInUseError: it is another's.
        """
        owner = self.owner()
        if owner != root:
            raise self._in_use(owner, root)

    def _in_use(self, owner: str | None, root: str) -> LocalTierInUseError:
        owner = owner or self.owner()
        holder = f"the job of the checkpoint root {owner}" if owner else "another job"
        return LocalTierInUseError(
            f"the local tier {self.base} is in use by {holder}, which is running: two jobs in one tier would "
            f"remove each other's shards. Give this job (root {root}) its own LocalTier(dir=...)",
            str(self.base),
            owner,
        )

    def _take_over(self, owner: str | None, root: str) -> None:
        """(the lock held exclusively) Remove the shards of the tier's previous owner
        (``None``: unrecorded) and record the job of ``root`` as its owner."""
        gone = [e for e in _entries(self.base) if e.name.startswith("rank_") and e.name[5:].isdigit()]
        for entry in gone:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        if gone:
            whose = f"of the job of the checkpoint root {owner}" if owner else "of an unrecorded job"
            _log.warning(
                "asyncckpt: the local tier %s held the shards %s (%d shard directories): removed, "
                "this job (root %s) takes the tier over",
                self.base,
                whose,
                len(gone),
                root,
            )
        tmp = self.base / f".{OWNER_NAME}.tmp-{secrets.token_hex(4)}"
        _fs.write_new_file(tmp, json.dumps({"root": root}).encode())
        os.replace(tmp, self.base / OWNER_NAME)
        _fs.fsync_directory(self.base)

    # ------------------------------------------------------------------ replicas
    def pack(self, rank: int, step: int, read: bool = False) -> Packed:
        """Rank ``rank``'s shard of ``step``, to send or to read: its files (the manifest's
        data files, then the manifest), each mapped read-only-in-effect (``MAP_PRIVATE``,
        never written: no copy of the bytes, which are in memory already on a RAM tier;
        pages fault in where they are read). With ``read``: the files kept open too, to
        be read with :meth:`Packed.readinto`. Close it after use.

        Raises:
            CorruptCheckpointError: the shard is missing, a file shorter than its manifest.
            OSError: a file could not be opened or mapped.
        """
        directory = self.step_dir(rank, step)
        manifest = _manifest.read_manifest(directory)
        names = sorted(manifest["files"]) + [_manifest.MANIFEST_NAME]
        packed = Packed([], [], directory=directory)
        dir_fd = _fs.open_dir(str(directory))
        try:
            for name in names:
                fd = _fs.open_member(dir_fd, str(directory), name)
                try:
                    size = os.fstat(fd).st_size
                    want = manifest["files"][name]["size"] if name != _manifest.MANIFEST_NAME else size
                    if size != want:
                        raise CorruptCheckpointError(f"{directory / name} has {size} bytes, not {want}", str(directory))
                    packed.files.append((name, size))
                    packed.maps.append(mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None)
                finally:
                    if read:
                        packed.fds.append(fd)
                    else:
                        os.close(fd)
        except BaseException:
            packed.close()
            raise
        finally:
            os.close(dir_fd)
        return packed

    def arrival(self, rank: int, step: int, files: list[tuple[str, int]]) -> Arrival:
        """Where rank ``rank``'s shard of ``step`` is received: its files created in a
        hidden directory with their sizes and mapped (``MAP_SHARED``), so that the
        transfer writes into them directly; :meth:`Arrival.finish` checks and commits.

        Raises:
            CorruptCheckpointError: a file name that is not a plain name.
            OSError: any I/O failure (nothing is kept).
        """
        final = self.step_dir(rank, step)
        for name, _ in files:
            if not _manifest.is_plain_name(name):
                raise CorruptCheckpointError(f"a replica names a file {name!r}", str(final))
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.temporary_dir(final, secrets.token_hex(8))
        arrival = Arrival(final, tmp, list(files), [], [])
        try:
            if not self._take_spare(tmp, {name for name, _ in files}):
                tmp.mkdir()
            for name, size in files:
                fd = os.open(tmp / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
                arrival.fds.append(fd)
                os.ftruncate(fd, size)
                # (MAP_POPULATE: the page tables filled at once, not one fault per page)
                arrival.maps.append(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE) if size else None)
        except BaseException:
            arrival.discard()
            raise
        return arrival

    def spare_bytes(self, rank: int) -> int:
        """Bytes of rank ``rank``'s spare on this node (its files' sizes; 0: none): the
        memory its next step is written into, not allocated again."""
        total = 0
        for spare in _entries(self.shard_dir(rank)):
            if spare.name.startswith(_SPARE_PREFIX):
                for entry in _entries(spare):
                    try:
                        total += entry.lstat().st_size
                    except OSError:
                        pass
                break  # (one spare a shard)
        return total

    def _take_spare(self, tmp: Path, keep: set[str]) -> bool:
        """Make the shard's spare (an older step of it, hidden by :meth:`mark_restorable`)
        the new step's directory ``tmp``, its files named in ``keep`` left to be written
        over (their memory is there), the others removed. False: no spare (nothing done).

        Raises:
            OSError: a file of the spare could not be removed (``tmp`` exists then).
        """
        for spare in _entries(tmp.parent):
            if not spare.name.startswith(_SPARE_PREFIX):
                continue
            try:
                os.rename(spare, tmp)  # atomic: a concurrent mark_restorable removes it whole or not at all
            except OSError:
                continue
            for entry in _entries(tmp):
                if entry.name not in keep or entry.is_symlink() or not entry.is_file():
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry)
                    else:
                        entry.unlink()
            return True
        return False

    def write_rank(self, task: WriteTask) -> RankWriteResult:
        """Write this rank's staged files of a local save (the background worker) into
        ``task.directory``, which is the shard's spare when it has one (its files written
        over: on a RAM tier, no page freed by the last mark is allocated and zeroed
        again; :class:`~asyncckpt.io.writer.WriteTask` ``reuse``).

        Raises:
            OSError: any I/O failure.
        """
        tmp = Path(task.directory)
        if not tmp.exists() and self._take_spare(tmp, {spec.name for spec in task.files}):
            task = task._replace(reuse=True)
        return super().write_rank(task)

    def receive(self, rank: int, step: int, files: list[tuple[str, int]], data: memoryview) -> Path:
        """Store rank ``rank``'s shard of ``step`` from ``data`` (the files in order, the
        manifest last): written into a hidden directory, every byte checked against the
        manifest's sizes and CRC-32s, fsynced, then renamed into place (replacing a copy
        of the same step that is there).

        Returns:
            The committed directory.

        Raises:
            CorruptCheckpointError: a file does not match the manifest (nothing is kept).
            OSError: any I/O failure (nothing is kept).
        """
        arrival = self.arrival(rank, step, files)
        try:
            pos = 0
            for buf, (_, size) in zip(arrival.maps, files):
                if buf is not None:
                    buf[:] = data[pos : pos + size]
                pos += size
        except BaseException:
            arrival.discard()
            raise
        return arrival.finish()


@dataclass
class Packed:
    """A shard to send or read (:meth:`NodeLocalStorage.pack`): ``files`` ``[(name,
    size)]``, the mapping of each (``None`` for an empty file), and, when packed to
    read, each file's descriptor. :meth:`close` unmaps and closes them."""

    files: list[tuple[str, int]]
    maps: list[mmap.mmap | None]
    fds: list[int] = field(default_factory=list)
    directory: Path | None = None
    _paths: dict[int, str] = field(default_factory=dict, repr=False)

    def readinto(self, index: int, offset: int, views: list[memoryview]) -> None:
        """Fill ``views`` (in order) with the bytes of file ``index`` from ``offset``
        (``os.preadv``: the kernel copies from the page cache into memory mapped
        already; no page of this process is mapped or unmapped).

        Raises:
            CorruptCheckpointError: the file ends first.
            OSError: the read failed.
        """
        path = self._paths.get(index)
        if path is None:  # (once per file: it is read 2 MiB at a time)
            name = self.files[index][0]
            path = self._paths[index] = str(self.directory / name if self.directory else name)
        preadv_all(self.fds[index], views, offset, path)

    def close(self) -> None:
        for m in self.maps:
            if m is not None:
                m.close()
        for fd in self.fds:
            os.close(fd)
        self.maps, self.fds = [], []


@dataclass
class Arrival:
    """A shard being received (:meth:`NodeLocalStorage.arrival`): its hidden directory,
    and each file's descriptor and shared mapping (``None`` for an empty file)."""

    final: Path
    tmp: Path
    files: list[tuple[str, int]]
    fds: list[int]
    maps: list[mmap.mmap | None]

    def _close(self) -> None:
        for m in self.maps:
            if m is not None:
                m.close()
        for fd in self.fds:
            os.close(fd)
        self.maps, self.fds = [], []

    def finish(self) -> Path:
        """Check every byte against the manifest received, make the files durable and
        rename the directory into place (a copy of the same step there is replaced).

        Returns:
            The committed directory.

        Raises:
            CorruptCheckpointError: a file does not match (nothing is kept).
            OSError: any I/O failure (nothing is kept).
        """
        try:
            views = [memoryview(m) if m is not None else memoryview(b"") for m in self.maps]
            try:
                _check_received(self.files, views, self.final)
            finally:
                for view in views:
                    view.release()  # before the mappings close
            for fd in self.fds:
                os.fsync(fd)
            self._close()
            _fs.fsync_directory(self.tmp)
            if self.final.exists():
                _fs.remove_checkpoint(self.final, best_effort=True)
            os.rename(self.tmp, self.final)
            _fs.fsync_directory(self.final.parent)
        except BaseException:
            self.discard()
            raise
        return self.final

    def discard(self) -> None:
        """Remove what arrived (never raises)."""
        try:
            self._close()
        except (OSError, BufferError):
            pass
        shutil.rmtree(self.tmp, ignore_errors=True)


def _check_received(files: list[tuple[str, int]], views: list[memoryview], where: Path) -> None:
    """Check a received shard (the files of :meth:`NodeLocalStorage.pack`, the manifest
    last; ``views[i]`` holds file ``i``) against its manifest: the same files, sizes and
    the CRC-32 of every segment.

    Raises:
        CorruptCheckpointError: naming the first file that does not match.
    """
    if not files or files[-1][0] != _manifest.MANIFEST_NAME or [len(v) for v in views] != [n for _, n in files]:
        raise CorruptCheckpointError("a replica arrived with a layout other than its header's", str(where))
    try:
        manifest = json.loads(bytes(views[-1]))
        entries = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"a replica arrived with an unreadable manifest: {exc}", str(where)) from exc
    names = [name for name, _ in files[:-1]]
    if not isinstance(entries, dict) or sorted(entries) != sorted(names):
        raise CorruptCheckpointError(f"a replica's files {names} are not its manifest's", str(where))
    for view, (name, size) in zip(views, files[:-1]):
        if entries[name].get("size") != size:
            raise CorruptCheckpointError(f"a replica's {name!r} does not match its manifest", str(where / name))
        check_segments(entries[name], [view], where / name)


def check_segments(
    entry: dict[str, Any],
    views: list[memoryview],
    path: Path,
    fill: Callable[[int, int, int], int] | None = None,
    checked: Callable[[int], None] | None = None,
) -> None:
    """Check the bytes of one file, held by ``views`` in file order (pieces of any
    lengths), against its manifest entry (``entry["segments"]``: ``[offset, length,
    crc32]``, covering the file): each segment's CRC-32 is folded over the pieces it
    spans (no copy).

    Args:
        fill: lands bytes ``[lo, hi)`` of ``views[i]`` (``fill(i, lo, hi)``; e.g. a read
            into them) just before they are checked, at most :data:`CHECK_CHUNK_BYTES`
            at a time, so that the CRC reads them from the cache, and returns the file
            offset up to which the views hold their bytes now (it may land more: it is
            called again only past that); every byte of the views is landed once, and
            the segments must then cover the file in order.
        checked: called with the file offset up to which the bytes have been read by
            the CRC (in order, at most :data:`CHECK_CHUNK_BYTES` at a time), so that
            the caller uses them while the cache holds them; a segment's verdict
            comes only at its end (what ``checked`` did with bytes of a segment that
            then fails is the caller's to undo or overwrite).

    Raises:
        CorruptCheckpointError: the pieces are not the entry's size, segments that do
            not cover the file, or the first segment whose CRC-32 differs (naming its
            bytes).
    """
    size = sum(len(v) for v in views)
    if entry.get("size") != size:
        raise CorruptCheckpointError(f"{path} has {size} bytes, its manifest says {entry.get('size')}", str(path))
    step = CHECK_CHUNK_BYTES if fill is not None or checked is not None else size
    i, start, covered, landed = 0, 0, 0, 0  # the piece holding file offset ``start``; the bytes covered in order
    for offset, length, expected in entry["segments"]:
        if offset + length > size or (fill is not None and offset != covered):
            raise CorruptCheckpointError(f"{path}: manifest segments do not cover the file", str(path))
        actual, pos, end = 0, offset, offset + length
        while pos < end:
            while start + len(views[i]) <= pos:
                start += len(views[i])
                i += 1
            lo = pos - start
            take = min(end - pos, len(views[i]) - lo, step)
            if fill is not None and pos + take > landed:
                landed = fill(i, lo, lo + take)
            actual = crc32(views[i][lo : lo + take], actual)
            pos += take
            if checked is not None:
                checked(pos)
        covered = end
        if actual != expected:
            raise CorruptCheckpointError(
                f"{path}: checksum mismatch in bytes [{offset}, {end}) "
                f"(crc32 {actual & 0xFFFFFFFF:08x}, manifest {expected:08x})",
                str(path),
            )
    if fill is not None and covered != size:
        raise CorruptCheckpointError(f"{path}: manifest segments do not cover the file", str(path))


def _read_small(path: Path, limit: int = 1 << 16) -> bytes:
    """The bytes of a small record file (at most ``limit``), never blocking on a FIFO
    nor following a symlink there (:func:`asyncckpt._fs.open_no_follow`).

    Raises:
        OSError: it cannot be opened.
        CorruptCheckpointError: it is a symlink or not a regular file.
    """
    fd = _fs.open_no_follow(path)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _flock(fd: int, kind: int, wait_s: float) -> bool:
    """``flock(fd, kind)``, retried for up to ``wait_s`` seconds; False: not taken.

    Raises:
        OSError: other than the lock being held elsewhere.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
