"""Saves still pending when the interpreter exits or their manager is dropped: commit them within a bound, or name them as lost."""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import multiprocessing.util as mp_util
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable

from asyncckpt.async_utils.calls_queue import AsyncCallsQueue
from asyncckpt.root import EXIT_TIMEOUT_ENV, exit_timeout
from asyncckpt.saving import destroy_hook as _destroy_hook  # noqa: F401 - pending saves commit before destroy_process_group()
from asyncckpt.saving.record import SaveInFlight

if TYPE_CHECKING:
    from asyncckpt.saving.saver import Saver

_log = logging.getLogger("asyncckpt")

# ====================================================================== interpreter exit
#: Every saver of this process (a forked child forgets its parent's).
_live_savers: "weakref.WeakSet[Saver]" = weakref.WeakSet()
#: Pending saves get ``root.exit_timeout()`` seconds at exit to commit; one still
#: pending then is lost, and named.
_exit_done: list[int] = []  # the pid whose exit hook ran (it runs once per process)


def _describe_save(record: SaveInFlight) -> str:
    """``step N (path)`` for a manager's save, else its path."""
    return f"step {record.step} ({record.final_dir})" if record.step is not None else str(record.final_dir)


def _settle_or_name(pending: list[tuple[bool, SaveInFlight]], timeout: float, when: str,
                    hint: str = "") -> list[SaveInFlight]:
    """Wait up to ``timeout`` seconds in all for the saves finalized in the background
    (``(True, record)``) to settle, then name each one still pending and each failed
    one (a warning on logger ``asyncckpt``, shown on stderr). Returns those pending."""
    deadline = time.monotonic() + timeout
    for background, record in pending:
        if background:
            concurrent.futures.wait([record.handle], max(0.0, deadline - time.monotonic()))
    lost = []
    for _, record in pending:
        handle = record.handle
        if not handle.done():
            lost.append(record)
            _log.warning("asyncckpt: the save of %s was still pending %s and is lost (not committed; waited "
                         "%.0f s, %s)%s", _describe_save(record), when, timeout, EXIT_TIMEOUT_ENV, hint)
        elif handle.exception() is not None:
            _log.warning("asyncckpt: the save of %s, pending %s, failed: %s", _describe_save(record), when,
                         str(handle.exception()).splitlines()[0])
    return lost


def _settle_pending_at_exit() -> None:
    """At interpreter exit: let pending saves commit, for a bounded time, then name each
    one that is lost (a ``logging`` warning on logger ``asyncckpt``, shown on stderr).

    Runs before the workers are stopped (atexit is last-in first-out, and this module
    registers after :mod:`asyncckpt.async_utils.callers`; on multiprocessing's exit path, with a
    higher priority). Saves of a queue finalized in the training loop cannot commit
    without the loop: they are named at once.
    """
    if os.getpid() in _exit_done:
        return
    _exit_done.append(os.getpid())  # also tells the threads of dropped managers (below)
    pending = []
    queues: dict[int, AsyncCallsQueue] = {}
    for saver in list(_live_savers):
        queue = saver._queue_ref()
        if queue is None or queue.closed or queue.caller.foreign:
            continue
        try:
            saver.synchronize_staging()  # an overlapped save still copying: hand it to the writer
        except Exception:  # noqa: BLE001 - at exit: its failure is reported through its handle
            pass
        records = saver.pending_records()
        pending += [(queue.background_finalize, record) for record in records]
        queues.update((id(record), queue) for record in records)
    if not pending:
        return
    lost = _settle_or_name(pending, exit_timeout(), "at interpreter exit", "; call close() or wait() before exiting")
    # A lost save's queue is aborted now, while the interpreter is whole: its finalizer
    # thread must not be left inside a call (waiting for the writer, or in a collective)
    # when the process groups are torn down (gloo then aborts the process).
    for queue in {id(q): q for q in (queues[id(record)] for record in lost)}.values():
        try:
            queue.close(abort=True)
        except Exception as exc:  # noqa: BLE001 - at exit: nobody left to raise it to
            _log.debug("aborting a queue at exit failed: %s", exc)


atexit.register(_settle_pending_at_exit)
# A process started by multiprocessing exits through its own exit path (no atexit):
# run there too, before asyncckpt.async_utils.callers stops the workers (priority 100).
mp_util.Finalize(None, _settle_pending_at_exit, exitpriority=150)
os.register_at_fork(after_in_child=_live_savers.clear)


# ====================================================================== a dropped manager
def release_when_settled(saver: Saver, queue: AsyncCallsQueue | None,
                         then: Callable[[], None] | None = None) -> None:
    """What a ``CheckpointManager`` collected without ``close()`` leaves to do (and
    ``close()`` itself, for saves still pending on a queue passed in).

    Its pending saves still commit: a thread (``asyncckpt-dropped-manager``) holds the
    saver and the manager's own queue (``queue``; ``None`` for a queue passed in)
    until every save settled (an overlapped one is handed to the writer first; on a
    queue passed in, which another thread may be scheduling on, it is dropped and
    named), names each failed one, then frees the staging buffers and closes the
    manager's own queue. Without
    pending saves this frees the buffers at once (and the queue goes with its last
    reference). A save still pending at interpreter exit is left to the exit's bound
    and named there. ``then`` (the manager's root lock release) runs last, once no
    save of the manager can commit any more. Runs in whichever thread collected the
    manager.
    """
    q = saver._queue_ref()
    if q is None or q.closed or q.caller.foreign or not saver.busy():
        saver.release()
        if then is not None:
            then()
        return
    threading.Thread(target=_finish_dropped, args=(saver, queue, then), name="asyncckpt-dropped-manager",
                     daemon=True).start()


def _finish_dropped(saver: Saver, queue: AsyncCallsQueue | None, then: Callable[[], None] | None) -> None:
    try:
        _settle_dropped(saver, queue)
    finally:
        if then is not None:
            then()


def _settle_dropped(saver: Saver, queue: AsyncCallsQueue | None) -> None:
    if queue is not None:  # the manager's own queue: nobody else schedules on it now
        try:
            saver.synchronize_staging()  # an overlapped save still copying: hand it to the writer
        except Exception:  # noqa: BLE001 - reported through its handle
            pass
    records = saver.pending_records()
    for record in records:
        concurrent.futures.wait([record.handle])  # committed by the queue's finalizer (or failed, or aborted)
    if os.getpid() in _exit_done:
        return  # the interpreter exits: its hook named what is lost, its exit path stops the worker
    for record in records:
        if record.handle.exception() is not None:
            _log.warning("asyncckpt: the save of %s, pending when its CheckpointManager was dropped without "
                         "close(), failed: %s", _describe_save(record),
                         str(record.handle.exception()).splitlines()[0])
    overlapped = saver._overlapped
    if overlapped is not None:  # a queue passed in: its owner's thread schedules on it, not this one
        _log.warning("asyncckpt: the save of %s is dropped: it was never handed to the writer (its "
                     "CheckpointManager was closed with abort=True, or dropped without close(), before "
                     "synchronize_staging())", _describe_save(overlapped.save))
    saver.release()
    if queue is not None:
        try:
            queue.close()
        except Exception as exc:  # noqa: BLE001 - nobody left to raise it to
            _log.warning("asyncckpt: closing the queue of a CheckpointManager dropped without close() failed: %s",
                         exc)


