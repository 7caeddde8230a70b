"""Saves still pending when the process exits, a process group is destroyed, or their
manager is dropped: commit them within a bound, or name them as lost.

This module knows a saver only through :class:`PendingSaves`, the few methods it
calls (the saver imports this module, never the other way round).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from asyncckpt import _exit
from asyncckpt._exit import EXIT_TIMEOUT_ENV, exit_timeout
from asyncckpt.dist import _TORCH_DEFAULT_TIMEOUT, SyncGroup, call_before_destroy
from asyncckpt.errors import CheckpointException

if TYPE_CHECKING:
    from asyncckpt.async_utils.calls_queue import AsyncCallsQueue
    from asyncckpt.saving.record import SaveInFlight

_log = logging.getLogger("asyncckpt")


class PendingSaves(Protocol):
    """What this module asks of a saver (:class:`asyncckpt.saving.saver.Saver`)."""

    def live_queue(self) -> AsyncCallsQueue | None:
        """The saver's queue, ``None`` once it was garbage-collected."""

    def synchronize_staging(self) -> None:
        """Hand an overlapped save still copying to the writer (no-op without one)."""

    def pending_records(self) -> list[SaveInFlight]:
        """The saves scheduled and not settled yet, in call order."""

    def overlapped_record(self) -> SaveInFlight | None:
        """The overlapped save not handed to the writer yet, else ``None``."""

    def busy(self) -> bool:
        """True while a save is being staged (overlapped) or is pending."""

    def unreported_failures(self) -> list[tuple[SaveInFlight, BaseException]]:
        """The saves that failed and whose failure nobody was told of, in call order."""

    def release(self) -> None:
        """Free the staging buffers (never blocks on a write)."""


# ====================================================================== the savers of this process
class _Savers(weakref.WeakSet[PendingSaves]):
    """Every saver of this process. Adding one arms the exit registry (its pending
    saves are settled at exit) and, the first time, makes ``destroy_process_group()``
    settle them first (:func:`settle_pending_before_destroy`); a forked child forgets
    its parent's savers."""

    def add(self, item: PendingSaves) -> None:
        _exit.arm()
        call_before_destroy(settle_pending_before_destroy)  # idempotent
        super().add(item)


_live_savers: _Savers = _Savers()


def _describe_save(record: SaveInFlight) -> str:
    """``step N (path)`` for a manager's save, else its path."""
    return f"step {record.step} ({record.final_dir})" if record.step is not None else str(record.final_dir)


def describe_failure(exc: BaseException) -> str:
    """One line naming a failure and its cause: a :class:`CheckpointException`'s head
    with each failing rank's first line (``... failed on rank(s) 0: [rank 0] OSError:
    ...``), else ``Type: message``."""
    if isinstance(exc, CheckpointException):
        head = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        causes = [f"[rank {rank}] {(cause.strip().splitlines() or [''])[0]}" for rank, cause in exc.failures.items()]
        return " ".join([head, *causes])
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _settle_or_name(
    pending: list[tuple[bool, SaveInFlight]], timeout: float, when: str, hint: str = "", bound: str = EXIT_TIMEOUT_ENV
) -> list[SaveInFlight]:
    """Wait up to ``timeout`` seconds in all for the saves finalized in the background
    (``(True, record)``) to settle, then name each one still pending and each failed
    one, with its cause (a warning on logger ``asyncckpt``, shown on stderr);
    ``bound`` names where ``timeout`` comes from. Returns those still pending.

    Raises:
        BaseException: the interrupt (Ctrl-C, ``SystemExit``) that ended the wait,
            once every save still pending is named as lost.
    """
    started = time.monotonic()
    deadline = started + timeout
    interrupt: BaseException | None = None
    try:
        for background, record in pending:
            if background:
                concurrent.futures.wait([record.handle], max(0.0, deadline - time.monotonic()))
    except BaseException as exc:  # noqa: BLE001 - named below, then raised
        interrupt = exc
    lost = []
    for background, record in pending:
        handle = record.handle
        if not handle.done():
            lost.append(record)
            if interrupt is not None:
                why = f"interrupted by {type(interrupt).__name__} after {time.monotonic() - started:.0f} s"
            elif background:
                why = f"waited {time.monotonic() - started:.0f} s, {bound}"
            else:
                why = "its queue is finalized in the training loop"
            _log.warning(
                "asyncckpt: the save of %s was still pending %s and is lost (not committed; %s)%s",
                _describe_save(record),
                when,
                why,
                hint,
            )
        elif (error := handle.exception(timeout=0)) is not None:
            _log.warning(
                "asyncckpt: the save of %s, pending %s, failed: %s",
                _describe_save(record),
                when,
                describe_failure(error),
            )
    if interrupt is not None:
        raise interrupt
    return lost


def name_unreported(failures: list[tuple[SaveInFlight, BaseException]], when: str) -> None:
    """Name each save of ``failures`` (failed before ``when``, its failure never seen
    through ``wait()`` or a harvest) with its cause, on logger ``asyncckpt``; each then
    counts as reported (it is not named again)."""
    for record, exc in failures:
        record.reported = True
        _log.warning(
            "asyncckpt: the save of %s failed (not reported before %s): %s",
            _describe_save(record),
            when.removeprefix("when ").removeprefix("at "),
            describe_failure(exc),
        )


def settle_pending(
    timeout: Callable[[AsyncCallsQueue], float],
    when: str,
    hint: str,
    bound: str,
    *,
    group: Any = ...,
    abort_lost: bool = False,
    announce: bool = False,
) -> list[SaveInFlight]:
    """Let the pending saves of every saver of this process (only those of queues on
    ``group``, when given) commit, then name each one lost or failed.

    An overlapped save still copying is handed to the writer first. Saves of a queue
    finalized in the training loop cannot commit without the loop: they are named at
    once.

    Args:
        timeout: the bound in seconds for a queue's saves; the wait is bounded by the
            largest of the queues involved.
        when: the occasion, for the messages (``"at interpreter exit"``).
        hint: appended to the message naming a lost save.
        bound: what sets ``timeout``, for the messages (``ASYNCCKPT_EXIT_TIMEOUT_S``).
        group: only the queues on this process group (default: all).
        abort_lost: abort (``close(abort=True)``) each queue holding a lost save (all
            of them when the wait is interrupted, before the interrupt is re-raised),
            while the interpreter is whole: its finalizer thread must not be left
            inside a call (waiting for the writer, or in a collective, perhaps holding
            the caller's lock) when the interpreter finalizes (a queue collected then
            waits for that lock forever) or the process groups are torn down (gloo
            then aborts the process).
        announce: log (info) which saves are waited for.

    Returns:
        The saves still pending.
    """
    pending: list[tuple[bool, SaveInFlight]] = []
    queues: dict[int, AsyncCallsQueue] = {}
    bound_s = 0.0
    for saver in list(_live_savers):
        queue = saver.live_queue()
        if queue is None or queue.closed or queue.caller.foreign:
            continue
        if group is not ... and queue._process_group is not group:
            continue
        try:
            saver.synchronize_staging()  # an overlapped save still copying: hand it to the writer
        except Exception:  # noqa: BLE001 - its failure is reported through its handle
            pass
        records = saver.pending_records()
        if records:
            bound_s = max(bound_s, timeout(queue))
        pending += [(queue.background_finalize, record) for record in records]
        queues.update((id(record), queue) for record in records)
    if not pending:
        return []
    if announce:
        _log.info(
            "asyncckpt: %s, waiting for %d pending save(s) to commit: %s",
            when,
            len(pending),
            ", ".join(_describe_save(record) for _, record in pending),
        )
    try:
        lost = _settle_or_name(pending, bound_s, when, hint, bound)
    except BaseException:  # Ctrl-C, the preemption budget: drop them all at once
        if abort_lost:
            _abort_queues([queues[id(record)] for _, record in pending])
        raise
    if abort_lost:
        _abort_queues([queues[id(record)] for record in lost])
    return lost


def _abort_queues(queues: list[AsyncCallsQueue]) -> None:
    for queue in {id(q): q for q in queues}.values():
        try:
            queue.close(abort=True)
        except Exception as exc:  # noqa: BLE001 - at exit: nobody left to raise it to
            _log.debug("aborting a queue at exit failed: %s", exc)


def _settle_pending_at_exit() -> None:
    """The exit phase ``COMMIT_SAVES``: pending saves get ``ASYNCCKPT_EXIT_TIMEOUT_S``
    seconds (default 5) in all to commit; each one still pending then is named as lost
    (a ``logging`` warning on logger ``asyncckpt``, shown on stderr) and its queue is
    aborted; each that failed, then or before the exit without anybody told (no
    ``wait()``, no ``maybe_finalize``), is named with its cause; interrupted (Ctrl-C,
    here or in an earlier phase), every queue with pending saves is aborted at once.
    The workers are stopped later (phase ``STOP_WORKERS``)."""
    bound = 0.0 if _exit.interrupted() else exit_timeout()  # after Ctrl-C: name and abort at once
    earlier: list[tuple[SaveInFlight, BaseException]] = []
    for saver in list(_live_savers):  # failed before the exit, never reported: named too
        queue = saver.live_queue()
        if queue is None or not queue.caller.foreign:
            earlier += saver.unreported_failures()
    try:
        settle_pending(
            lambda _queue: bound,
            "at interpreter exit",
            "; call close() or wait() before exiting",
            EXIT_TIMEOUT_ENV,
            abort_lost=True,
        )
    finally:
        name_unreported(earlier, "at interpreter exit")


_exit.register(_exit.COMMIT_SAVES, _settle_pending_at_exit, forget=_live_savers.clear)


# ====================================================================== destroy_process_group()
def _group_timeout_s(queue: AsyncCallsQueue) -> float:
    return max(SyncGroup(queue._process_group).timeout, _TORCH_DEFAULT_TIMEOUT).total_seconds()


def settle_pending_before_destroy(group: Any) -> None:
    """(each rank, in ``destroy_process_group(group)``) Let every pending save of the
    queues on ``group`` (``None``: all groups) commit, then name each one still pending
    as lost (a warning on logger ``asyncckpt``), and each that failed.

    A script that ends with ``dist.destroy_process_group()`` and no ``close()`` (a
    common ending) would otherwise destroy the groups the background commit runs on
    while a save is pending: the save lost, or, with a collective broken on one rank
    only, half committed. asyncckpt wraps ``destroy_process_group``
    (:mod:`asyncckpt._destroy`, installed on ``import asyncckpt``); the first saver of
    the process registers this function there (:func:`asyncckpt.dist.call_before_destroy`).
    Each rank waits for its pending saves to settle (every rank's finalizer still has
    its group, so the commit runs as usual), then the groups are destroyed.

    An overlapped staging still copying is handed to the writer first. Saves of a queue
    finalized in the training loop cannot commit here (it needs the loop): they are
    named at once. The wait is bounded by the group's collective timeout (at least
    torch's default, 30 minutes): a peer that is gone fails the commit much sooner.
    """
    settle_pending(
        _group_timeout_s,
        "at destroy_process_group()",
        "; call close() or wait() before destroying the process group",
        "the process group's timeout",
        group=... if group is None else group,
        announce=True,
    )


# ====================================================================== a dropped manager
def release_when_settled(
    saver: PendingSaves, queue: AsyncCallsQueue | None, then: Callable[[], None] | None = None
) -> None:
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
    q = saver.live_queue()
    if q is None or q.closed or q.caller.foreign or not saver.busy():
        saver.release()
        if then is not None:
            then()
        return
    threading.Thread(
        target=_finish_dropped, args=(saver, queue, then), name="asyncckpt-dropped-manager", daemon=True
    ).start()


def _finish_dropped(saver: PendingSaves, queue: AsyncCallsQueue | None, then: Callable[[], None] | None) -> None:
    try:
        _settle_dropped(saver, queue)
    finally:
        if then is not None:
            then()


def _settle_dropped(saver: PendingSaves, queue: AsyncCallsQueue | None) -> None:
    if queue is not None:  # the manager's own queue: nobody else schedules on it now
        try:
            saver.synchronize_staging()  # an overlapped save still copying: hand it to the writer
        except Exception:  # noqa: BLE001 - reported through its handle
            pass
    records = saver.pending_records()
    for record in records:
        concurrent.futures.wait([record.handle])  # committed by the queue's finalizer (or failed, or aborted)
    if _exit.exiting():
        return  # the process exits: its exit named what is lost, and stops the worker
    for record in records:
        if (error := record.handle.exception(timeout=0)) is not None:
            _log.warning(
                "asyncckpt: the save of %s, pending when its CheckpointManager was dropped without close(), failed: %s",
                _describe_save(record),
                describe_failure(error),
            )
    overlapped = saver.overlapped_record()
    if overlapped is not None:  # a queue passed in: its owner's thread schedules on it, not this one
        _log.warning(
            "asyncckpt: the save of %s is dropped: it was never handed to the writer (its "
            "CheckpointManager was closed with abort=True, or dropped without close(), before "
            "synchronize_staging())",
            _describe_save(overlapped),
        )
    saver.release()
    if queue is not None:
        try:
            queue.close()
        except Exception as exc:  # noqa: BLE001 - nobody left to raise it to
            _log.warning("asyncckpt: closing the queue of a CheckpointManager dropped without close() failed: %s", exc)
