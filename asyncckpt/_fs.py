"""File-system helpers of the local tier: durable names, files opened without following
symlinks, and removal of a checkpoint directory by a hidden name first.

Torch-free (the background writer imports this module).
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import threading
from pathlib import Path

from asyncckpt.errors import CorruptCheckpointError

__all__ = [
    "fsync_directory",
    "current_umask",
    "write_new_file",
    "open_no_follow",
    "open_dir",
    "open_member",
    "remove_checkpoint",
]


def fsync_directory(path: str | os.PathLike) -> None:
    """fsync a directory so that the names created or renamed in it are durable.

    Raises:
        OSError: the directory cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """This process's umask, read without changing it (Linux ``/proc``; else set and
    restore, briefly)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_new_file(path: Path, data: bytes) -> None:
    """Create ``path`` (``O_EXCL``: never through an existing file or symlink), write
    ``data`` and fsync it (the name is durable once its directory is fsynced).

    Raises:
        FileExistsError: ``path`` exists.
        OSError: any other I/O failure.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def open_no_follow(path: Path) -> int:
    """Open the regular file ``path`` for reading, never through a symlink.

    Returns:
        A read-only descriptor (the caller closes it).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CorruptCheckpointError: ``path`` is a symlink or not a regular file.
        OSError: any other failure.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptCheckpointError(
                f"{path} is a symlink; checkpoint files must be regular files", str(path)
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{path} is not a regular file", str(path))
    return fd


def open_dir(root: str) -> int:
    """A read-only descriptor of the checkpoint directory ``root`` (the caller closes it).

    Raises:
        CorruptCheckpointError: ``root`` does not exist or is not a directory.
    """
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{root} does not exist", root) from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{root} cannot be opened as a directory: {exc}", root) from exc


def open_member(dir_fd: int, root: str, name: str) -> int:
    """Open the regular file ``name`` of the directory ``dir_fd`` (whose path is
    ``root``, for messages) for reading, never through a symlink.

    Returns:
        A read-only descriptor (the caller closes it).

    Raises:
        CorruptCheckpointError: missing, a symlink, not a regular file, or unreadable.
    """
    path = os.path.join(root, name)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing", path) from None
    except OSError as exc:
        if os.path.islink(path):
            raise CorruptCheckpointError(f"{path} is a symlink; checkpoint files must be regular files", path) from None
        raise CorruptCheckpointError(f"{path} cannot be opened: {exc}", path) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{path} is not a regular file", path)
    return fd


def _doomed_name(name: str) -> str:
    """The hidden name a directory is renamed to before it is removed:
    ``.step_N.deleting-<hex>`` for ``step_N`` and for its temporary ``.step_N.tmp-<hex>``
    (the names ``asyncckpt.format.naming.LEFTOVER_RE`` matches)."""
    base = name[1:].rsplit(".tmp-", 1)[0] if name.startswith(".") and ".tmp-" in name else name
    return f".{base}.deleting-{secrets.token_hex(6)}"


def remove_checkpoint(path: Path, background: bool = False, *, best_effort: bool = False) -> threading.Thread | None:
    """Delete a checkpoint directory (or a save's temporary directory): first renamed to
    a hidden ``.deleting-`` name (so a crash mid-delete never leaves a partial directory
    under a committed name, and whoever waits for a temporary name sees it go at once),
    the parent fsynced, then removed.

    Args:
        path: the directory.
        background: remove the renamed directory in a daemon thread (returned) so
            that the caller (the training thread, in a commit) does not wait for the
            unlinks; a removal cut short by exit leaves a hidden ``.deleting-`` name
            that ``CheckpointManager`` and ``asyncckpt clean`` remove later.
        best_effort: never raise: a ``path`` already gone is no error, a rename that
            fails removes ``path`` in place, a failed fsync is ignored (the discard of
            a failed save).

    Returns:
        The removing thread with ``background``, else ``None``.

    Raises:
        OSError: (without ``best_effort``) the rename or the fsync failed.
    """
    doomed = path.parent / _doomed_name(path.name)
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        if not best_effort:
            raise
        return None
    except OSError:
        if not best_effort:
            raise
        doomed = path
    else:
        try:
            fsync_directory(path.parent)
        except OSError:
            if not best_effort:
                raise
    if not background:
        shutil.rmtree(doomed, ignore_errors=True)
        return None
    thread = threading.Thread(
        target=shutil.rmtree,
        args=(doomed,),
        kwargs={"ignore_errors": True},
        name=f"asyncckpt-retention:{doomed.name}",
        daemon=True,
    )
    thread.start()
    return thread


# ---------------------------------------------------------------------- held flocks
#: The descriptors of the ``flock`` s this process holds for as long as it runs (a
#: root's, a local tier's), each with the token :func:`hold_lock_fd` gave for it: a
#: forked child closes its copies at once.
_held_lock_fds: dict[int, object] = {}
_held_lock_fds_lock = threading.Lock()


def hold_lock_fd(fd: int) -> object:
    """Remember ``fd`` (whose ``flock`` this process holds): a child of ``os.fork()``
    closes its copy, so that it never keeps a lock its parent has let go (a ``flock``
    lasts until every descriptor of it is closed; a forked writer or a DataLoader
    worker would hold a dead trainer's root or tier).

    Returns:
        The token to give :func:`release_lock_fd`.
    """
    token = object()
    with _held_lock_fds_lock:
        _held_lock_fds[fd] = token
    return token


def release_lock_fd(fd: int, token: object) -> None:
    """Close ``fd``, dropping its ``flock``, if it is still the one :func:`hold_lock_fd`
    gave ``token`` for: once, and never a later lock opened under the same number (in
    this process after the release, or in a forked child, which closed its copies at
    the fork)."""
    with _held_lock_fds_lock:
        if _held_lock_fds.get(fd) is not token:
            return
        del _held_lock_fds[fd]
    os.close(fd)


def _close_held_lock_fds_in_child() -> None:
    global _held_lock_fds_lock
    _held_lock_fds_lock = threading.Lock()  # another thread may have held it at the fork
    for fd in _held_lock_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _held_lock_fds.clear()


os.register_at_fork(after_in_child=_close_held_lock_fds_in_child)
