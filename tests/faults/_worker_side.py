"""Helpers that run inside the persistent background worker (kept torch-free).

The fault tests arm a failpoint in a worker that is already running by scheduling one
of these functions as an ordinary ``async_fn`` on the manager's queue: the worker's
environment (or resource limit) changes for the calls that follow, and only there.
"""

from __future__ import annotations

import os
import resource
import signal


def set_env(name: str, value: str | None) -> int:
    """Set (``value``) or remove (``None``) an environment variable; returns the pid."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    return os.getpid()


def set_fsize_limit(nbytes: int | None) -> int:
    """Limit the size of files this process writes (``RLIMIT_FSIZE``), or lift it.

    ``SIGXFSZ`` is ignored while limited, so that a write past the limit fails with
    ``EFBIG`` ("File too large") instead of killing the process. Returns the pid.
    """
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if nbytes is None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    else:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(nbytes), hard))
    return os.getpid()
