"""The one exit registry: what asyncckpt does when its process exits, and in which order.

The order is data, :data:`PHASES`, read top to bottom:

1. ``COMMIT_LIGHTNING`` -- each Lightning plugin with pending saves is torn down
   (its saves commit and are swapped into place; :mod:`asyncckpt.lightning`).
2. ``COMMIT_SAVES`` -- pending saves get ``ASYNCCKPT_EXIT_TIMEOUT_S`` seconds in all
   to commit; each one still pending then is named as lost and its queue aborted
   (:mod:`asyncckpt.saving.pending`). Their commits start retention removals, so:
3. ``FINISH_DELETIONS`` -- retention removals in flight get the same bound, so that no
   ``.step_N.deleting-*`` directory is left (:mod:`asyncckpt.root`).
4. ``FINISH_UPLOADS`` -- uploads to a remote tier queued or in flight (the saves
   committed above queue theirs) get the same bound; each step not uploaded then is
   named and cancelled, and uploaded again at the next start (:mod:`asyncckpt.upload`).
5. ``STOP_WORKERS`` -- every worker process and forked child still running is asked
   to exit, then SIGTERM, then SIGKILL (:mod:`asyncckpt.async_utils.processes`). It
   comes after the commits: they need the workers to finish the writes.
6. ``RELEASE_GROUPS`` -- the cached gloo groups are dropped while the interpreter is
   whole (:mod:`asyncckpt.dist`): one destroyed during interpreter finalization can
   abort the process after a run that succeeded. Last: the commits above use them.

A module adds its hook to a phase with :func:`register` when it is imported; the
order inside a phase is the order of registration. The registry's one function,
:func:`run`, is handed to the interpreter twice, and runs once per process:

- ``atexit``: a process that ends normally. It is registered after
  ``multiprocessing.util`` is imported, so it runs before multiprocessing's own exit
  function (atexit is last-in first-out), which would terminate our daemonic workers
  and then join every child without a time limit.
- ``multiprocessing.util.Finalize`` with :data:`EXIT_PRIORITY`, above every priority
  multiprocessing itself uses (at most 15): a process started by multiprocessing (a
  rank of ``torch.multiprocessing.start_processes``) exits through multiprocessing's
  exit path, which skips atexit. Started with fork or forkserver, such a process
  clears the finalizers it inherited (from a parent, or a fork server, that had
  imported asyncckpt) before its target runs, so the finalizer is installed by
  :func:`arm`, which every module calls when it starts something the exit must wait
  for or stop (a worker, a saver, a removal, a plugin's writer); :func:`arm` installs
  it again when it finds it gone.

Interrupts: a hook that raises an ``Exception`` is logged and the next one runs. Ctrl-C
(``KeyboardInterrupt``) or a ``SystemExit`` (the preemption budget's
``PreemptionBudgetExpired``) while a hook waits ends the waiting: the phases left are
skipped, except ``COMMIT_SAVES``, which then waits no more (it names the pending saves
as lost and aborts their queues, so that no finalizer thread is left inside a call
while the interpreter finalizes), ``FINISH_UPLOADS``, which names the uploads not done
without waiting, and ``STOP_WORKERS``. :func:`interrupted` tells a
hook. Only the first Ctrl-C interrupts: while :func:`run` runs in the main thread
with Python's default SIGINT handler, it installs one that raises
``KeyboardInterrupt`` once and ignores the later ones, so that a second Ctrl-C cannot
cut short the naming of what is lost nor the stopping of the workers (it restores the
previous handler when it returns).

Saves from atexit handlers: a user's handler may run before :func:`run` (registered
after asyncckpt's) or after it (registered before). :func:`in_atexit_handler` tells
the save path that it runs in one, where a save is made synchronous (as ``torch.save``
there); one made after :func:`run` finished then calls :func:`clean_up_again`, which
runs the cleaning phases (``FINISH_DELETIONS``, ``STOP_WORKERS``, ``RELEASE_GROUPS``)
once more.

Fork: a child of ``os.fork()`` forgets its parent's entries (each phase's ``forget``
callables run in the child); its workers, savers and removals are the parent's.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util as mp_util  # before atexit.register below: see the module docstring
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "PHASES",
    "COMMIT_LIGHTNING",
    "COMMIT_SAVES",
    "FINISH_DELETIONS",
    "FINISH_UPLOADS",
    "STOP_WORKERS",
    "RELEASE_GROUPS",
    "EXIT_TIMEOUT_ENV",
    "exit_timeout",
    "register",
    "arm",
    "run",
    "exiting",
    "interrupted",
    "in_atexit_handler",
    "clean_up_again",
]

_log = logging.getLogger("asyncckpt")

COMMIT_LIGHTNING = "commit Lightning's pending saves"
COMMIT_SAVES = "commit pending saves"
FINISH_DELETIONS = "finish retention deletions"
FINISH_UPLOADS = "finish uploads to the remote tier"
STOP_WORKERS = "stop worker processes"
RELEASE_GROUPS = "release the gloo groups"
#: The phases, in the order they run at exit.
PHASES: tuple[str, ...] = (
    COMMIT_LIGHTNING,
    COMMIT_SAVES,
    FINISH_DELETIONS,
    FINISH_UPLOADS,
    STOP_WORKERS,
    RELEASE_GROUPS,
)
#: The phases that run even after an interrupt ended an earlier one (without waiting).
_ALWAYS = frozenset({COMMIT_SAVES, FINISH_UPLOADS, STOP_WORKERS, RELEASE_GROUPS})
#: The phases that clean up (nothing of theirs waits for a save): run again by
#: :func:`clean_up_again`.
_CLEANING = (FINISH_DELETIONS, STOP_WORKERS, RELEASE_GROUPS)
#: The priority of the ``multiprocessing.util.Finalize`` that runs :func:`run`.
EXIT_PRIORITY = 100

#: The environment variable of the bound, in seconds, on what the exit (and a ``with
#: CheckpointManager`` block ended by an exception) waits for: pending saves, then
#: retention removals in flight (each phase its own bound).
EXIT_TIMEOUT_ENV = "ASYNCCKPT_EXIT_TIMEOUT_S"
DEFAULT_EXIT_TIMEOUT_S = 5.0


def exit_timeout() -> float:
    """The bound on one waiting phase at exit: ``ASYNCCKPT_EXIT_TIMEOUT_S`` seconds (default 5)."""
    try:
        return float(os.environ.get(EXIT_TIMEOUT_ENV, DEFAULT_EXIT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_EXIT_TIMEOUT_S


_hooks: dict[str, dict[str, Callable[[], None]]] = {phase: {} for phase in PHASES}
_forgets: dict[str, Callable[[], None]] = {}
_lock = threading.Lock()
_finalizer: mp_util.Finalize | None = None
_armed_pid: int | None = None
_ran_pid: int | None = None
_finished_pid: int | None = None
_interrupted: BaseException | None = None


def register(phase: str, hook: Callable[[], None], *, forget: Callable[[], None] | None = None) -> None:
    """Run ``hook()`` in ``phase`` at exit; ``forget()`` in a child of ``os.fork()``.

    Idempotent per function (by module and qualified name): a module imported again
    replaces its hooks.

    Raises:
        ValueError: ``phase`` is not one of :data:`PHASES`.
    """
    if phase not in _hooks:
        raise ValueError(f"unknown exit phase {phase!r}; the phases are {', '.join(PHASES)}")
    key = f"{hook.__module__}.{hook.__qualname__}"
    with _lock:
        _hooks[phase][key] = hook
        if forget is not None:
            _forgets[key] = forget


def arm() -> None:
    """Make sure :func:`run` runs when this process exits, also through
    multiprocessing's exit path (cheap; call it whenever something is started that the
    exit must wait for or stop)."""
    global _finalizer, _armed_pid
    pid = os.getpid()
    if _armed_pid == pid and _finalizer is not None and _finalizer.still_active():
        return
    with _lock:
        if _armed_pid != pid or _finalizer is None or not _finalizer.still_active():
            _finalizer = mp_util.Finalize(None, run, exitpriority=EXIT_PRIORITY)
            _armed_pid = pid


def exiting() -> bool:
    """True once this process's exit has started running the phases."""
    return _ran_pid == os.getpid()


def interrupted() -> bool:
    """True once an interrupt (Ctrl-C, ``SystemExit``) ended a phase of this exit:
    the hooks left must not wait."""
    return exiting() and _interrupted is not None


def in_atexit_handler() -> bool:
    """True in the main thread once its code has finished: in an atexit handler (or
    in :func:`run`). ``threading`` marks the main thread stopped at the start of the
    interpreter's shutdown, before the atexit handlers run; no other thread is the
    main thread, so a thread still training after the main thread returned is not
    taken for an exit. About a microsecond."""
    main = threading.main_thread()
    return threading.current_thread() is main and not main.is_alive()


def clean_up_again() -> None:
    """After :func:`run` finished in this process (an atexit handler registered before
    asyncckpt's saved after it): run the cleaning phases once more (finish retention
    removals, stop worker processes, release the gloo groups). No-op before."""
    if _finished_pid != os.getpid():
        return
    with _lock:
        hooks = [hook for phase in _CLEANING for hook in _hooks[phase].values()]
    for hook in hooks:
        try:
            hook()
        except Exception as exc:  # noqa: BLE001 - at exit: nobody left to raise it to
            _log.warning("asyncckpt: at exit, cleaning up again failed: %s: %s", type(exc).__name__, exc)


class _FirstInterruptOnly:
    """While :func:`run` runs: the SIGINT handler that raises ``KeyboardInterrupt`` for
    the first Ctrl-C only (the later ones find the exit already dropping what is
    pending). Installed only in the main thread, over Python's default handler (a
    handler of the user's own is left alone)."""

    def __init__(self) -> None:
        self.previous: Any = None
        self.fired = False

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        try:
            if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                return False
            self.previous = signal.signal(signal.SIGINT, self)
        except (ValueError, OSError):  # not the main interpreter, or no signals here
            return False
        return True

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.fired:
            self.fired = True  # before raising: a second SIGINT in between is ignored too
            raise KeyboardInterrupt

    def restore(self) -> None:
        try:
            signal.signal(signal.SIGINT, self.previous)
        except (ValueError, OSError):
            pass


def run() -> None:
    """Run the phases in order (once per process; later calls return at once)."""
    global _ran_pid, _finished_pid, _interrupted
    with _lock:
        if _ran_pid == os.getpid():
            return
        _ran_pid = os.getpid()
        _interrupted = None
        phases = [(phase, list(_hooks[phase].values())) for phase in PHASES]
    sigint = _FirstInterruptOnly()
    installed = sigint.install()
    try:
        _run_phases(phases)
    finally:
        _finished_pid = os.getpid()
        if installed:
            sigint.restore()


def _run_phases(phases: list[tuple[str, list[Callable[[], None]]]]) -> None:
    global _interrupted
    for phase, hooks in phases:
        if _interrupted is not None and phase not in _ALWAYS:
            continue
        for hook in hooks:
            try:
                hook()
            except Exception as exc:  # noqa: BLE001 - at exit: nobody left to raise it to
                _log.warning("asyncckpt: at exit, %s failed: %s: %s", phase, type(exc).__name__, exc)
            except BaseException as exc:  # noqa: BLE001 - Ctrl-C, the preemption budget: stop waiting
                if _interrupted is None:
                    _log.warning(
                        "asyncckpt: %s at exit while it had to %s: what is pending is dropped, the workers are stopped",
                        type(exc).__name__,
                        phase,
                    )
                _interrupted = exc
                break


def _after_fork_in_child() -> None:
    """The child of ``os.fork()``: the parent's entries are not its own."""
    global _lock, _ran_pid, _finished_pid, _interrupted
    _lock = threading.Lock()  # another thread may have held it at the fork
    _ran_pid = None
    _finished_pid = None
    _interrupted = None
    for forget in list(_forgets.values()):
        forget()


atexit.register(run)
os.register_at_fork(after_in_child=_after_fork_in_child)
