"""Put a new directory in place of an old one, atomically where the system can.

Linux ``renameat2(RENAME_EXCHANGE)`` swaps two names in one step, so the final name
always names a complete directory; elsewhere the old one is renamed aside first. Used
by the Lightning plugin to replace ``last.ckpt`` by a newer save; torch-free.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from asyncckpt.io.writer import fsync_directory

__all__ = ["rename_exchange", "remove_path", "replace_path"]

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc: Any = None


def rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names ``a`` and ``b`` (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns:
        False if the system cannot (no ``renameat2``, or the filesystem refuses).

    Raises:
        OSError: any other failure (e.g. ``b`` does not exist).
    """
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = False
    fn = getattr(_libc, "renameat2", None) if _libc else None
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def remove_path(path: Path) -> None:
    """Remove ``path`` (a directory tree, a file or a link); nothing if it is gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def replace_path(new: Path, final: Path, *, exchange: bool = True) -> Path | None:
    """Put the directory ``new`` in place of ``final`` (a checkpoint directory or file).

    With ``exchange`` (and a system that supports it) the two names are swapped in
    one atomic step: ``final`` always names a complete checkpoint. Otherwise ``final``
    is renamed aside first, then ``new`` into place (a crash in between leaves both
    under hidden names, none under ``final``).

    Returns:
        The hidden path now holding what ``final`` held (to be removed), or ``None``
        if ``final`` did not exist.
    """
    if exchange and os.path.lexists(final) and rename_exchange(new, final):
        old = new
    elif os.path.lexists(final):
        old = final.parent / f".{final.name}.asyncckpt-old-{secrets.token_hex(6)}"
        os.rename(final, old)
        os.rename(new, final)
    else:
        os.rename(new, final)
        old = None
    fsync_directory(str(final.parent))
    return old
