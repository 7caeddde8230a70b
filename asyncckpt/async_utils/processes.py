"""The processes the callers start (persistent workers, forked children): tracked so
that the process's exit stops them, and terminated with a bound.

Every process a caller starts is registered here with an optional callable that asks
it to exit at once (the persistent worker's ABORT message). The exit registry
(:mod:`asyncckpt._exit`) stops those still running in its last phase,
``STOP_WORKERS``, even without ``close()``: a save not finalized by then stays
uncommitted. A child of ``os.fork()`` forgets the registry: the processes are its
parent's (stopping them would abort the parent's saves in flight).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from asyncckpt import _exit

__all__ = ["TERMINATE_GRACE_S", "track", "untrack", "terminate", "terminate_many"]

#: Seconds between SIGTERM and SIGKILL when a worker or child is terminated.
TERMINATE_GRACE_S = 3.0
#: The grace at exit, shorter: the exit is bounded.
EXIT_GRACE_S = 1.0

_live_processes: dict[Any, Callable[[], None] | None] = {}
_live_lock = threading.Lock()


def track(proc: Any, abort: Callable[[], None] | None = None) -> None:
    """Stop ``proc`` (a started ``multiprocessing.Process``) at exit; ``abort()`` asks
    it to exit at once (may raise ``OSError``/``ValueError`` once it is gone)."""
    _exit.arm()
    with _live_lock:
        _live_processes[proc] = abort


def untrack(proc: Any) -> None:
    """Forget ``proc`` (it was reaped)."""
    with _live_lock:
        _live_processes.pop(proc, None)


def terminate_many(procs: list[Any], grace_s: float = TERMINATE_GRACE_S) -> None:
    """Ask to exit (ABORT message) and SIGTERM all, wait up to ``grace_s`` seconds in
    total, SIGKILL the rest; reap all."""
    for proc in procs:
        with _live_lock:
            abort = _live_processes.get(proc)
        try:
            if abort is not None:
                abort()
        except (OSError, ValueError):
            pass
        try:
            if proc.is_alive():
                proc.terminate()
        except (OSError, ValueError, AssertionError):
            pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(grace_s)
        except (OSError, ValueError, AssertionError):
            pass
        finally:
            untrack(proc)


def terminate(proc: Any, grace_s: float = TERMINATE_GRACE_S) -> None:
    """SIGTERM, wait up to ``grace_s`` seconds, then SIGKILL; always reaps."""
    terminate_many([proc], grace_s)


def _stop_all_at_exit() -> None:
    with _live_lock:
        procs = list(_live_processes)
    terminate_many(procs, grace_s=EXIT_GRACE_S)


def _forget_after_fork() -> None:
    """In a child of ``os.fork()`` (user code, a DataLoader worker): the workers and
    children are the parent's, never this process's to stop. Without this, the child's
    exit would abort the parent's worker (its ABORT message goes down the inherited
    pipe) and fail the parent's save in flight."""
    global _live_lock
    _live_lock = threading.Lock()  # another thread may have held it at the fork
    _live_processes.clear()


_exit.register(_exit.STOP_WORKERS, _stop_all_at_exit, forget=_forget_after_fork)
