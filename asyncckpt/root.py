"""A checkpoint root: numbered step directories, ``latest``, retention and leftovers.

Shared by ``CheckpointManager`` and the ``asyncckpt`` command. Torch-free (the
command's ``ls``, ``verify`` and ``clean`` do not import torch).

Layout (the names are Orbax-like policy as data: :mod:`asyncckpt.format.naming`)::

    root/step_00000100/            a committed checkpoint (a DCP directory + manifest)
    root/latest                    the name of the newest save committed, for readers
    root/.step_00000200.tmp-<hex>  a save in flight, or the leftover of a failed one
    root/.step_00000050.deleting-<hex>   an old checkpoint being removed
    root/.asyncckpt.manager.lock   the lock a CheckpointManager holds for its lifetime
    root/.asyncckpt.manager.owner  who holds it (JSON: pid, host, since)
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import math
import os
import secrets
import shutil
import socket
import stat
import threading
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from asyncckpt import _exit, _faults, _fs
from asyncckpt._check import check_path
from asyncckpt._exit import EXIT_TIMEOUT_ENV, exit_timeout
from asyncckpt._fs import remove_checkpoint
from asyncckpt.errors import (
    CheckpointNotFoundError,
    CheckpointPathError,
    InvalidArgumentError,
    RootInUseError,
)
from asyncckpt.format import manifest as _manifest
from asyncckpt.format.naming import LEFTOVER_RE, STEP_DIR_RE, parse_leftover, parse_step_dir, step_dir_name
from asyncckpt.io.commit import write_latest
from asyncckpt.policy import PreservationPolicy, StepInfo, as_policy, steps_to_remove

__all__ = [
    "STEP_DIR_RE",
    "LEFTOVER_RE",
    "OWNER_LOCK_NAME",
    "OWNER_INFO_NAME",
    "step_dir_name",
    "parse_step_dir",
    "parse_leftover",
    "is_in_root",
    "is_stock_dcp",
    "RootEntry",
    "CheckpointRoot",
]

_log = logging.getLogger("asyncckpt")

#: The lock a ``CheckpointManager`` holds on its root for its lifetime (a ``flock``
#: on a descriptor opened read-only: the kernel drops it when its process dies), and the file
#: naming its holder.
OWNER_LOCK_NAME = ".asyncckpt.manager.lock"
OWNER_INFO_NAME = ".asyncckpt.manager.owner"


#: Retention removals in flight in this process (every root's), joined at exit: a
#: removal cut short by the exit would leave a ``.step_N.deleting-*`` directory.
_deletions: set[threading.Thread] = set()
_deletions_lock = threading.Lock()


def _join_deletions_at_exit() -> None:
    """The exit phase ``FINISH_DELETIONS``: let the retention removals in flight
    finish (up to ``ASYNCCKPT_EXIT_TIMEOUT_S`` seconds, default 5), so that an exit
    without ``close()`` leaves no ``.step_N.deleting-*`` directory; name one cut short
    (the next commit into the root, or ``asyncckpt clean``, removes it). It runs after
    the phase that commits the pending saves, whose commits start removals.
    """
    with _deletions_lock:
        threads = list(_deletions)
    if not threads:
        return
    timeout = exit_timeout()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            _log.warning(
                "asyncckpt: the removal of an old checkpoint (%s, retention) did not finish within "
                "%.0f s at exit (%s); the next commit into its root or `asyncckpt clean` removes it",
                thread.name.partition(":")[2],
                timeout,
                EXIT_TIMEOUT_ENV,
            )


def _forget_deletions_in_child() -> None:
    """A forked child: the removals in flight are its parent's threads (gone here)."""
    global _deletions_lock
    _deletions_lock = threading.Lock()
    _deletions.clear()


_exit.register(_exit.FINISH_DELETIONS, _join_deletions_at_exit, forget=_forget_deletions_in_child)


def is_in_root(checkpoint_dir: str | os.PathLike) -> bool:
    """Whether ``checkpoint_dir`` is (or was) a checkpoint of an asyncckpt root, so that a
    missing ``.manifest.json`` means it is damaged, not a stock DCP directory.

    True when the directory holds ``.records.json`` (only asyncckpt writes it), or its
    name is ``step_N`` and its parent holds a sign of a ``CheckpointManager``: a
    ``latest`` file, the manager's lock file, or another ``step_M`` directory with a
    manifest. A stock ``dcp.save`` directory anywhere else (even named ``step_N``) is
    not ours.
    """
    path = Path(checkpoint_dir).absolute()
    if os.path.lexists(path / _manifest.RECORDS_NAME):
        return True
    if parse_step_dir(path.name) is None:
        return False
    parent = path.parent
    if any(os.path.lexists(parent / name) for name in (_manifest.LATEST_NAME, OWNER_LOCK_NAME, _manifest.LOCK_NAME)):
        return True
    try:
        with os.scandir(parent) as it:
            for entry in it:
                if (
                    entry.name != path.name
                    and parse_step_dir(entry.name) is not None
                    and os.path.lexists(os.path.join(entry.path, _manifest.MANIFEST_NAME))
                ):
                    return True
    except OSError:
        pass
    return False


def is_stock_dcp(checkpoint_dir: str | os.PathLike) -> bool:
    """Whether ``checkpoint_dir`` is a stock ``torch.distributed.checkpoint`` directory:
    it holds ``.metadata`` but no ``.manifest.json``, and is not a checkpoint of an
    asyncckpt root (:func:`is_in_root`: one of ours that lost its manifest is damaged,
    not stock)."""
    path = Path(checkpoint_dir)
    return (
        not os.path.lexists(path / _manifest.MANIFEST_NAME)
        and os.path.isfile(path / _manifest.METADATA_NAME)
        and not os.path.islink(path / _manifest.METADATA_NAME)
        and not is_in_root(path)
    )


def _uint(value: Any) -> int:
    """A manifest's non-negative int field, or 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _finite(value: Any) -> float:
    """A manifest's time field (seconds since the epoch), or 0.0."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else 0.0


def _metrics(value: Any) -> dict[str, float]:
    """A manifest's ``metrics``: its finite numbers by name (anything else is dropped)."""
    if not isinstance(value, dict):
        return {}
    return {k: float(v) for k, v in value.items() if isinstance(k, str) and _finite(v) == v and not isinstance(v, bool)}


class RootEntry(NamedTuple):
    """A directory of a checkpoint root (:meth:`CheckpointRoot.scan`).

    Attributes:
        name: the directory name.
        path: its path.
        step: the step its name carries; ``None`` for a directory of another name (a
            Lightning ``dirpath``'s ``epoch=0-step=16.ckpt``, a foreign ``step_6``).
        kind: ``"committed"`` (a manifest and ``.metadata``; ``step`` is ``None`` when
            its name is not a step's: not one of the manager's steps), ``"uncommitted"``
            (``step_N`` without them: a stock DCP directory, or not a checkpoint),
            ``"temporary"`` (``.step_N.tmp-*``: a save in flight, or the leftover of a
            failed one), ``"deleting"`` (``.step_N.deleting-*``: a removal) or
            ``"foreign"`` (any other visible directory, not committed: ``step_6``,
            ``step_000000009``, ``step_٤``, ``logs``; never listed as a step, never
            removed).
    """

    name: str
    path: Path
    step: int | None
    kind: str


class CheckpointRoot:
    """One root directory of numbered checkpoints and its retention policy.

    Args:
        root_dir: the directory (created if missing, with ``create``).
        keep_last: keep this many newest committed steps (``None``: keep all); the
            short form of ``keep=LatestN(keep_last)``.
        keep: a preservation policy (:mod:`asyncckpt.policy`: ``LatestN``,
            ``EveryNSteps``, ``EveryNSeconds``, ``BestN``, ``AnyOf``); with
            ``keep_last`` too, a step is kept if either keeps it. Retention never
            removes the newest save.
        create: create ``root_dir`` if it is missing (a manager that saves); without
            it (a reader: ``read_only=True``, the ``asyncckpt`` command) nothing is
            created, and a missing root raises ``CheckpointNotFoundError``.

    Raises:
        InvalidArgumentError: (a ``ValueError``) ``keep_last`` is not an int >= 1 or
            ``None``, ``keep`` not a policy; ``root_dir`` is not a path.
        CheckpointNotFoundError: (a ``FileNotFoundError``; without ``create``) there is
            no ``root_dir``.
        CheckpointPathError: the directory cannot be created, or is not a directory
            (it keeps the builtin type: ``PermissionError``, ``NotADirectoryError``,
            ``FileExistsError``, ...).
    """

    def __init__(
        self,
        root_dir: str | os.PathLike,
        keep_last: int | None = None,
        *,
        keep: PreservationPolicy | None = None,
        create: bool = True,
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
            raise InvalidArgumentError(f"keep_last must be an int >= 1 or None, not {keep_last!r}")
        #: The retention policy (``keep_last`` and ``keep`` combined; ``None``: keep all).
        self.policy = as_policy(keep_last, keep)
        self.path = Path(check_path(root_dir, what="root_dir")).absolute()
        if not create and not self.path.exists():
            raise CheckpointNotFoundError("no such checkpoint root (a reader creates nothing)", str(self.path))
        try:
            if create:
                self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointPathError.of(
                exc.errno, f"cannot create the checkpoint root {self.path}: {exc.strerror or exc}", self.path
            ) from exc
        if not self.path.is_dir():
            raise CheckpointPathError.of(errno.ENOTDIR, "the checkpoint root is not a directory", self.path)
        self._owner_fd: int | None = None  # the descriptor whose flock acquire_ownership() holds
        self._owner_pid = 0  # ... in this process
        self._owner_token: object = None
        self.keep_last = keep_last
        self._lock = threading.Lock()
        self._deletion: threading.Thread | None = None  # the retention removal in flight
        self._infos: dict[tuple[str, int], StepInfo] = {}  # (name, inode) -> what its manifest says

    def step_dir(self, step: int) -> Path:
        """The directory of step ``step``."""
        return self.path / step_dir_name(step)

    def acquire_ownership(self) -> None:
        """Take the root's lock (``.asyncckpt.manager.lock``) for this object's lifetime,
        and record the holder (pid, host, time) in ``.asyncckpt.manager.owner``.

        A ``flock`` (``LOCK_EX | LOCK_NB``): exclusive between processes (on any host
        that shares the file system with working ``flock``) and between two objects of
        one process (each opens its own file description); the kernel drops it when the
        holding process dies (also by SIGKILL), so a dead holder's lock is taken over.
        Released by :meth:`release_ownership`, or when the process ends; forked children
        close their copy of the descriptor (``os.register_at_fork``), so a DataLoader
        worker or a forked writer never keeps a dead trainer's root locked.

        The lock file is opened read-only, which is all ``flock`` needs: a descriptor
        open for writing on the checkpoint file system would make the kernel refuse to
        remount it read-only (``EBUSY``) for as long as the job runs. filelock, used for
        the short lock of ``latest``, always opens its file read-write, hence this one
        system call of our own.

        Raises:
            RootInUseError: another holder has it (named by pid and host).
            CheckpointPathError: the lock file cannot be created, is a symlink or is not
                a regular file (a FIFO there never blocks: it is opened ``O_NONBLOCK``);
                the root is not writable (``errno`` ``EROFS`` for a read-only mount,
                ``EACCES`` / ``EPERM`` for permissions: a ``PermissionError``). On every
                raise, no descriptor of the lock is left open: a retry, or another
                manager, never gets ``RootInUseError`` from this attempt.
        """
        if self._owner_fd is not None:
            return
        lock_path = self.path / OWNER_LOCK_NAME
        fd = self._open_lock_file(create=True)
        assert fd is not None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointPathError.of(
                    exc.errno, f"cannot lock the checkpoint root ({exc.strerror or exc})", lock_path
                ) from exc
            raise self._in_use_error() from None
        self._owner_fd, self._owner_pid = fd, os.getpid()
        self._owner_token = _fs.hold_lock_fd(fd)  # (a forked child closes its copy)
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        tmp = self.path / f"{OWNER_INFO_NAME}.tmp-{secrets.token_hex(6)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, json.dumps(info).encode())
            finally:
                os.close(fd)
            os.replace(tmp, self.path / OWNER_INFO_NAME)
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                # The root cannot be written (a read-only mount; no write permission,
                # also for root without CAP_DAC_OVERRIDE): every save would fail. The
                # lock file existed, so it could be opened; the lock goes with this error.
                self.release_ownership()
                raise CheckpointPathError.of(
                    exc.errno,
                    f"the checkpoint root is not writable ({exc.strerror or exc}); a CheckpointManager "
                    "that saves needs a writable root (to read only, use read_only=True, asyncckpt.load "
                    "or read_state_dict)",
                    self.path,
                ) from exc
            # Any other failure (e.g. ENOSPC): the lock holds; only the holder's description is missing.
            _log.warning("could not record the holder of %s: %s", lock_path, exc)

    def _open_lock_file(self, create: bool) -> int | None:
        """A read-only descriptor of ``.asyncckpt.manager.lock`` (created with ``create``;
        without it ``None`` when there is none). Never blocks and never follows a
        symlink: opened with ``O_NONBLOCK | O_NOFOLLOW`` and refused unless it is a
        regular file (a FIFO there would block an ordinary open for ever).

        Raises:
            CheckpointPathError: it cannot be opened or created (the builtin type of the
                cause: ``PermissionError``, ...), it is a symbolic link, or it is not a
                regular file (``IsADirectoryError`` for a directory).
        """
        lock_path = self.path / OWNER_LOCK_NAME
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_CREAT if create else 0)
        try:
            fd = os.open(lock_path, flags, 0o644)
        except FileNotFoundError:
            if create:
                raise CheckpointPathError.of(
                    errno.ENOENT, "the checkpoint root vanished before its lock file was created", lock_path
                ) from None
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink there is never ours: not followed
                raise CheckpointPathError.of(
                    exc.errno, "the lock file of the checkpoint root is a symbolic link", lock_path
                ) from exc
            raise CheckpointPathError.of(
                exc.errno,
                f"cannot {'create' if create else 'open'} the lock file of the checkpoint root "
                f"({exc.strerror or exc}); a CheckpointManager needs a writable "
                "root (to read checkpoints only, use read_only=True, asyncckpt.load or "
                "read_state_dict)",
                lock_path,
            ) from exc
        try:
            mode = os.fstat(fd).st_mode
        except OSError as exc:
            os.close(fd)
            raise CheckpointPathError.of(
                exc.errno, f"cannot stat the lock file ({exc.strerror or exc})", lock_path
            ) from exc
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise CheckpointPathError.of(
                errno.EISDIR if stat.S_ISDIR(mode) else None,
                "the lock file of the checkpoint root is not a regular file (remove it)",
                lock_path,
            )
        return fd

    def _in_use_error(self) -> RootInUseError:
        """The error naming the holder of the root's lock (from the owner file)."""
        owner = self.owner()
        pid, host = owner.get("pid"), owner.get("host")
        holder = f"process {pid} on host {host}" if pid is not None else "another process (holder unknown)"
        if pid == os.getpid() and host == socket.gethostname():
            holder = f"another CheckpointManager of this process (pid {pid} on host {host})"
        since = f", since {owner['since']}" if owner.get("since") else ""
        return RootInUseError(
            f"the checkpoint root {self.path} is in use by {holder}{since}: two managers saving into "
            "one root would overwrite each other's `latest` and remove each other's checkpoints. Use "
            "another directory, or close() the other manager first (reading needs no lock: "
            "asyncckpt.load, read_state_dict and the asyncckpt command work while it runs)",
            str(self.path),
            pid if isinstance(pid, int) else None,
            host if isinstance(host, str) else None,
        )

    def check_not_in_use(self) -> None:
        """Raise if a ``CheckpointManager`` (of any process) holds the root's lock now;
        for tools that change a root without being its manager (``asyncckpt clean``).

        A probe: the lock is taken and released at once (never created, never blocked
        on). A manager that opens the root right after the probe is not seen.

        Raises:
            RootInUseError: the lock is held (naming the holder, as a manager would).
            CheckpointPathError: the lock file is not a regular file, or cannot be opened.
        """
        if self._owner_fd is not None:
            return
        fd = self._open_lock_file(create=False)
        if fd is None:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise self._in_use_error() from None
                raise CheckpointPathError.of(
                    exc.errno, f"cannot probe the lock of the checkpoint root ({exc.strerror or exc})", self.path
                ) from exc
        finally:
            os.close(fd)  # drops the probe's lock

    def owner(self) -> dict[str, Any]:
        """The last recorded holder of the root's lock (``pid``, ``host``, ``since``), or
        ``{}`` when unknown. Informational: the lock itself is the ``flock``."""
        try:
            fd = os.open(self.path / OWNER_INFO_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO there must not block
                    return {}
                data = json.loads(os.read(fd, 4096).decode())
            finally:
                os.close(fd)
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def release_ownership(self) -> None:
        """Release the root's lock taken by :meth:`acquire_ownership` (idempotent)."""
        fd, self._owner_fd = self._owner_fd, None
        if fd is not None and self._owner_pid == os.getpid():  # a forked child closed its copy at fork
            _fs.release_lock_fd(fd, self._owner_token)  # drops the flock

    def steps(self) -> list[int]:
        """Committed steps, ascending (partial or temporary directories are ignored)."""
        found = []
        for entry in os.scandir(self.path):
            step = parse_step_dir(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False) and _manifest.is_committed(Path(entry.path)):
                found.append(step)
        return sorted(found)

    def scan(self) -> list[RootEntry]:
        """Every directory of the root, by name, with its kind (:class:`RootEntry`);
        symlinks are never followed, hidden names other than leftovers skipped.

        Raises:
            OSError: the root cannot be listed.
        """
        found = []
        with os.scandir(self.path) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            path = Path(entry.path)
            step = parse_step_dir(entry.name)
            if step is not None:
                kind = "committed" if _manifest.is_committed(path) else "uncommitted"
                found.append(RootEntry(entry.name, path, step, kind))
                continue
            leftover = parse_leftover(entry.name)
            if leftover is not None:
                kind = "temporary" if leftover[1] == "tmp" else "deleting"
                found.append(RootEntry(entry.name, path, leftover[0], kind))
            elif not entry.name.startswith("."):
                kind = "committed" if _manifest.is_committed(path) else "foreign"
                found.append(RootEntry(entry.name, path, None, kind))
        return found

    def commit_order(self) -> list[int]:
        """Committed steps, the oldest save first, the newest save last.

        The rollback policy: *the newest save wins*. Each commit through a
        ``CheckpointManager`` records a commit sequence number (``commit_seq``, one more
        than the largest in the root) in its manifest, so after a rollback (load step
        10 while 20 exists, then save 11, 12, 13) the order is 10, 20, 11, 12, 13: the
        run resumes from 13, and retention removes 10 and 20 first. Steps without a
        sequence number (older asyncckpt versions) order before all others, by step.
        """
        return [info.step for info in self.step_infos()]

    def latest(self) -> int | None:
        """The step of the newest save committed (what a run resumes from), or ``None``.

        ``root/latest`` names the same step once its update after the commit point
        is done; a crash between the two leaves ``latest`` one save behind, never ahead.
        """
        order = self.commit_order()
        return order[-1] if order else None

    def next_commit_seq(self) -> int:
        """(coordinator, at commit) The commit sequence number of the next commit."""
        return max((info.commit_seq for info in self.step_infos()), default=0) + 1

    def step_infos(self) -> list[StepInfo]:
        """What the retention policies see of every committed step (its commit
        sequence number, commit time and metrics, read from its manifest once and
        cached by name and inode; the cache keeps only the directories found, so it
        stays bounded over thousands of saves), oldest save first (:meth:`commit_order`).
        """
        found, seen = [], set()
        for entry in os.scandir(self.path):
            step = parse_step_dir(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False) and _manifest.is_committed(Path(entry.path)):
                seen.add((entry.name, entry.inode()))
                found.append(self._step_info(entry, step))
        with self._lock:
            for key in self._infos.keys() - seen:
                del self._infos[key]
        return sorted(found, key=lambda info: (info.commit_seq, info.step))

    def _step_info(self, entry: os.DirEntry, step: int) -> StepInfo:
        key = (entry.name, entry.inode())
        info = self._infos.get(key)
        if info is None:
            try:
                manifest = _manifest.read_manifest(entry.path)
            except Exception:  # noqa: BLE001 - unreadable or foreign: the oldest, no time, no metrics
                manifest = {}
            info = StepInfo(
                step,
                commit_seq=_uint(manifest.get("commit_seq")),
                created_unix_s=_finite(manifest.get("created_unix_s")),
                metrics=_metrics(manifest.get("metrics")),
            )
            with self._lock:
                self._infos[key] = info
        return info

    def after_commit(self, final_dir: Path, pending_steps: Iterable[int]) -> None:
        """(coordinator, after the commit point) ``latest``, retention, leftovers.

        The checkpoint is committed already (its rename is the commit point), so a
        failure here is reported as a ``RuntimeWarning`` (and logged), never as a
        failed save.

        Args:
            final_dir: the checkpoint just committed.
            pending_steps: steps of saves still in flight (their temporary
                directories are kept).
        """
        try:
            write_latest(self.path, final_dir.name)
        except Exception as exc:  # noqa: BLE001 - after the commit point: a warning
            self._warn(f"{final_dir} is committed, but `latest` could not be updated: {type(exc).__name__}: {exc}")
        _faults.hit("after_latest")
        if self.policy is not None:
            for old in steps_to_remove(self.policy, self.step_infos()):  # never the newest save
                path = self.step_dir(old)
                if path == final_dir:
                    continue
                self.join_deletion()  # at most one removal in flight: bounded disk use
                try:
                    with self._lock:
                        self._deletion = remove_checkpoint(path, background=True)
                        if self._deletion is not None:
                            _exit.arm()
                            with _deletions_lock:
                                _deletions.difference_update([t for t in _deletions if not t.is_alive()])
                                _deletions.add(self._deletion)
                except OSError as exc:
                    self._warn(f"retention could not remove {path}: {exc}")
        committed_step = parse_step_dir(final_dir.name)
        if committed_step is not None:
            self.remove_leftovers(committed_step, pending_steps)

    def remove_leftovers(self, committed_step: int, pending_steps: Iterable[int]) -> None:
        """Remove hidden temporary directories of steps up to ``committed_step`` (saves
        that failed or were killed: commits happen in call order, so none of them can
        still commit) and half-deleted old checkpoints; never those of ``pending_steps``
        nor the removal in flight."""
        pending = set(pending_steps)
        with self._lock:
            deletion = self._deletion
        being_deleted = deletion.name.partition(":")[2] if deletion is not None and deletion.is_alive() else None
        for entry in os.scandir(self.path):
            leftover = parse_leftover(entry.name)
            if (
                leftover is not None
                and leftover[0] <= committed_step
                and leftover[0] not in pending
                and entry.name != being_deleted
                and entry.is_dir(follow_symlinks=False)
            ):
                shutil.rmtree(entry.path, ignore_errors=True)

    def join_deletion(self) -> None:
        """Wait for the retention removal in flight, if any."""
        with self._lock:
            deletion, self._deletion = self._deletion, None
        if deletion is not None:
            deletion.join()
            with _deletions_lock:
                _deletions.discard(deletion)

    @staticmethod
    def _warn(message: str) -> None:
        _log.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
