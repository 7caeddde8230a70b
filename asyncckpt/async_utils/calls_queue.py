"""AsyncCallsQueue: schedule asynchronous calls and finalize them collectively.

One module over 600 lines, on purpose: the state machine of a call (``_Book``), the
finalizer thread and the queue share one condition, and each transition is made under
it; split apart, the invariants would span modules.

The shape is Megatron-core's ``AsyncCallsQueue``; the behaviour follows the contracts
of docs/DESIGN.md: per-rank failures (a raising or interrupted ``preload_fn``, a raising
``async_fn``, a dead worker, a forked child that exited non-zero) are recorded against
the call and reported on every rank as the same
:class:`~asyncckpt.errors.CheckpointException`. Completion is agreed on with one
all_gather of per-rank status over a dedicated gloo group.

Two ways to finalize:

- **In the training loop** (default, Megatron's semantics):
  :meth:`AsyncCallsQueue.maybe_finalize_async_calls` is called by every rank, in the
  same order; it runs the status all_gather and the ``finalize_fns`` in the calling
  thread.
- **In the background** (``background_finalize=True``, what ``CheckpointManager`` and
  ``asyncckpt.save`` use): one finalizer thread per queue, on a gloo group of its own,
  takes the calls strictly in ``call_idx`` order on every rank, waits for this rank's
  outcome, runs the status all_gather and the ``finalize_fns`` (their collectives use
  :attr:`AsyncCallsQueue.finalize_sync`). ``maybe_finalize_async_calls`` then only
  harvests outcomes: no collective, so ranks may call it different numbers of times.
  This is how DCP's ``async_save`` runs its collectives in its executor.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue as _queue
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncckpt.async_utils.callers import (
    WAIT_SLICE_S,
    AsyncCaller,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
)
from asyncckpt.async_utils.request import AsyncRequest
from asyncckpt.dist import SyncGroup
from asyncckpt.errors import CheckpointException, InvalidArgumentError, InvalidStateError, RankFailure

__all__ = ["AsyncCallsQueue", "SettleCallback"]

_log = logging.getLogger("asyncckpt")

_RUNNING, _OK, _FAILED = 0, 1, 2

#: The ``on_settled`` of :meth:`AsyncCallsQueue.schedule_async_request`: called once,
#: when the call is settled, with its ``call_idx`` and ``None`` (finalized: its
#: ``finalize_fns`` ran) or the :class:`CheckpointException` it failed with (also when
#: dropped by ``close(abort=True)``). Runs in the thread that settled the call: the
#: finalizer thread (``background_finalize=True``) or the thread that called
#: ``maybe_finalize_async_calls`` / ``close``, before the call stops counting as
#: pending. One that raises is logged and ignored: the call is settled all the same.
SettleCallback = Callable[[int, "CheckpointException | None"], None]


class _Book:
    """A queue's calls and their outcomes, shared by the training and finalizer threads:
    the one state machine of a call's life (docs/DESIGN.md, "the save's life").

    A call is *pending* (in ``pending``: scheduled, its ``async_fn`` running or done,
    not finalized), then *settling* (claimed by the one thread that finalizes or drops
    it: its ``finalize_fns`` and its ``on_settled`` run), then *settled* (failed:
    in ``failures``; in the background, with no ``on_settled``, queued in
    ``unharvested`` until ``maybe_finalize_async_calls`` reports it). A call scheduled
    with ``on_settled`` is *owned*: its owner reports its outcome, the queue's harvest
    never does.

    Everything here is guarded by ``cond``'s lock; no lock is held while a call
    runs, a finalize function runs, an ``on_settled`` runs, or a collective is in flight.
    """

    def __init__(self, caller: AsyncCaller, failures_kept: int) -> None:
        self.caller = caller
        self.cond = threading.Condition(threading.RLock())
        self.pending: dict[int, AsyncRequest] = {}  # insertion order is call_idx order
        #: Claimed, not settled yet: their finalize_fns (the commit) and on_settled run.
        self.settling: set[int] = set()
        self.preload_failures: dict[int, RankFailure] = {}
        self.results: dict[int, Any] = {}
        self.failures: collections.OrderedDict[int, CheckpointException] = collections.OrderedDict()
        self.failures_kept = failures_kept
        #: Settled in the background, not yet reported by maybe_finalize_async_calls.
        self.unharvested: collections.deque[tuple[int, CheckpointException | None]] = collections.deque()
        #: The ``on_settled`` of owned calls not settled yet (popped once, when settled).
        self.on_settled: dict[int, SettleCallback] = {}
        #: Owned calls not settled yet (their outcome is their owner's to report).
        self.owned: set[int] = set()
        self.background = False

    def local_status(
        self, call_idx: int, request: AsyncRequest, blocking: bool, stop: threading.Event | None = None
    ) -> tuple[int, RankFailure | None]:
        """This rank's status of ``call_idx`` (waiting for it with ``blocking``)."""
        with self.cond:
            failure = self.preload_failures.get(call_idx)
        if failure is not None:
            return _FAILED, failure
        if request.async_fn is None:
            return _OK, None
        if blocking:
            while self.caller.is_running(call_idx) and not (stop is not None and stop.is_set()):
                self.caller.wait_any(WAIT_SLICE_S)  # short: another thread may read the pipe
        outcome = self.caller.outcome(call_idx)
        if outcome is None:
            if blocking and not (stop is not None and stop.is_set()):
                # Not running and no outcome: it was never handed to the caller.
                return _FAILED, RankFailure(f"call {call_idx} was never started on this rank")
            return _RUNNING, None
        return (_OK, None) if outcome.ok else (_FAILED, outcome.error)

    def claim(self, call_idx: int) -> AsyncRequest | None:
        """Take ``call_idx`` out of the pending calls; ``None`` if another thread did.
        It is :meth:`unsettled` until :meth:`settle` publishes it."""
        with self.cond:
            request = self.pending.pop(call_idx, None)
            self.preload_failures.pop(call_idx, None)
            if request is not None:
                self.settling.add(call_idx)
            return request

    def unsettled(self, until: int | None = None) -> int:
        """How many calls (up to ``until``) are pending or being settled (hold ``cond``)."""
        return sum(1 for i in itertools.chain(self.pending, self.settling) if until is None or i <= until)

    def run_finalize(self, call_idx: int, request: AsyncRequest, rank: int) -> CheckpointException | None:
        """Run the ``finalize_fns`` of a call that succeeded everywhere (already claimed).

        Returns:
            ``None``, or the failure they raised (a ``CheckpointException`` as is,
            anything else wrapped). A ``BaseException`` that is not an ``Exception``
            (Ctrl-C) is re-raised after the call is settled as failed.
        """
        outcome = self.caller.pop_outcome(call_idx)
        self.results[call_idx] = None if outcome is None else outcome.value
        try:
            for fn in request.finalize_fns:
                fn()
        except CheckpointException as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - reported as the call's failure
            return CheckpointException(call_idx, {rank: RankFailure.from_exception(exc, "a finalize function raised ")})
        except BaseException as exc:
            self.settle(
                call_idx,
                CheckpointException(call_idx, {rank: RankFailure.from_exception(exc, "finalize interrupted: ")}),
            )
            raise
        finally:
            self.results.pop(call_idx, None)
        return None

    def settle(self, call_idx: int, exc: CheckpointException | None) -> None:
        """Settling to settled: record a claimed call's end, run its ``on_settled``
        (once, whoever settles), then publish it. A call settled already is left alone."""
        if exc is not None:
            self.caller.abandon(call_idx)
        with self.cond:
            if call_idx not in self.settling:
                return  # settled already (a stuck call dropped after its settler ended)
            on_settled = self.on_settled.pop(call_idx, None)
            owned = call_idx in self.owned
        if on_settled is not None:
            try:
                on_settled(call_idx, exc)
            except Exception:  # noqa: BLE001 - the owner's failure must not break the queue
                _log.exception("the on_settled of call %d raised", call_idx)
        with self.cond:
            if exc is not None:
                self.failures[call_idx] = exc
                while len(self.failures) > self.failures_kept:
                    self.failures.popitem(last=False)
            self.settling.discard(call_idx)
            self.owned.discard(call_idx)
            if self.background and not owned:
                self.unharvested.append((call_idx, exc))
            self.cond.notify_all()

    def drop_all(self, rank: int, why: str, settler_gone: bool = False) -> None:
        """Settle every pending call as failed with ``why`` (no collective).

        Args:
            settler_gone: the thread that claimed the calls being settled stopped
                without settling them (the finalizer died): settle those too.
        """
        with self.cond:
            call_idxs = list(self.pending)
            stuck = sorted(self.settling) if settler_gone else []
        for call_idx in call_idxs:
            if self.claim(call_idx) is not None:
                self.settle(call_idx, CheckpointException(call_idx, {rank: RankFailure(why)}))
        for call_idx in stuck:
            self.settle(call_idx, CheckpointException(call_idx, {rank: RankFailure(why)}))


class _Finalizer:
    """The background finalizer of one queue: a thread and its own gloo group.

    It holds no reference to the queue, so a dropped queue can be collected (and its
    ``__del__`` stops this thread and the worker).
    """

    def __init__(self, book: _Book, sync: SyncGroup) -> None:
        self.book = book
        self.sync = sync
        self.work: _queue.SimpleQueue[int | None] = _queue.SimpleQueue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="asyncckpt-finalizer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        book, sync = self.book, self.sync
        while True:
            call_idx = self.work.get()
            if call_idx is None or self.stop.is_set():
                return
            with book.cond:
                request = book.pending.get(call_idx)
            if request is None:
                continue  # dropped by close(abort=True)
            status, cause = book.local_status(call_idx, request, blocking=True, stop=self.stop)
            if self.stop.is_set():
                return  # aborting: no more collectives
            try:
                statuses = [s[0] for s in sync.all_gather_ints([status])]
                if _FAILED in statuses:
                    causes = sync.all_gather_object(cause)
                    exc: CheckpointException | None = CheckpointException(
                        call_idx, {r: c for r, c in enumerate(causes) if c is not None}
                    )
                    if book.claim(call_idx) is not None:
                        book.settle(call_idx, exc)
                    continue
                if book.claim(call_idx) is None:
                    continue
                exc = book.run_finalize(call_idx, request, sync.rank)
                book.settle(call_idx, exc)
            except BaseException as error:  # noqa: BLE001 - a broken collective: the ranks are out of step
                why = RankFailure.from_exception(error, "the background finalizer failed: ")
                if book.claim(call_idx) is not None:
                    book.settle(call_idx, CheckpointException(call_idx, {sync.rank: why}))
                book.drop_all(
                    sync.rank, "the background finalizer stopped after an earlier failure:\n" + why, settler_gone=True
                )
                self.stop.set()
                return

    def close(self, timeout: float | None) -> None:
        """Stop the thread after the calls it has (``timeout`` seconds at most)."""
        self.work.put(None)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
        if not self.thread.is_alive():
            self.sync.destroy()


class AsyncCallsQueue:
    """A FIFO of asynchronous calls, finalized in ``call_idx`` order.

    Args:
        persistent: use one long-lived worker (:class:`PersistentAsyncCaller`)
            instead of forking a child per call (:class:`TemporalAsyncCaller`).
        process_group: the ranks that schedule and finalize together (``None``: the
            default group, or a single process without ``torch.distributed``).
        start_method: ``"spawn"`` (default) or ``"forkserver"`` for the persistent
            worker; only with ``persistent=True``.
        import_main: whether the persistent worker re-imports the main script, so
            that ``async_fn`` s defined there can be unpickled (see
            :class:`PersistentAsyncCaller`); only with ``persistent=True``.
        caller: a caller instance to use instead (overrides ``persistent``).
        failures_kept: how many recent failures :meth:`get_failure` remembers.
        background_finalize: finalize in a thread of this queue instead of in
            :meth:`maybe_finalize_async_calls` (see the module docstring).

    Raises:
        InvalidArgumentError: (a ``ValueError``) ``start_method`` or ``import_main`` without ``persistent=True``,
            or with ``caller`` (they would be ignored); see also
            :class:`PersistentAsyncCaller`.

    Collective contract (all ranks of ``process_group``, in the same order):

    1. :meth:`schedule_async_request` (all ranks). The first one creates the
       finalizer's gloo group when ``background_finalize`` (or call :meth:`start`).
    2. :meth:`maybe_finalize_async_calls` (all ranks, unless ``no_dist=True``), only
       when not ``background_finalize``; with it, any rank, any number of times.
    3. :meth:`close` (all ranks; with ``abort=True``: any rank, no collective).

    A queue dropped without :meth:`close` is closed with ``abort=True`` when
    garbage-collected: its worker is stopped; pending calls are dropped (logged).
    """

    def __init__(
        self,
        persistent: bool = False,
        *,
        process_group: Any = None,
        start_method: str | None = None,
        import_main: bool | None = None,
        caller: AsyncCaller | None = None,
        failures_kept: int = 64,
        background_finalize: bool = False,
    ) -> None:
        self._closed = True  # until constructed: __del__ then does nothing
        given = [
            f"{name}={value!r}"
            for name, value in (("start_method", start_method), ("import_main", import_main))
            if value is not None
        ]
        if given and caller is not None:
            raise InvalidArgumentError(
                f"{' and '.join(given)} cannot be combined with caller=: the caller already decides how calls run"
            )
        if given and not persistent:
            raise InvalidArgumentError(
                f"{' and '.join(given)} need persistent=True: the persistent=False caller forks a "
                "child per call, with no worker to start"
            )
        if caller is None:
            caller = (
                PersistentAsyncCaller(start_method or "spawn", import_main) if persistent else TemporalAsyncCaller()
            )
        self.caller = caller
        self.persistent = isinstance(caller, PersistentAsyncCaller)
        self.background_finalize = bool(background_finalize)
        self._process_group = process_group
        self._sync: SyncGroup | None = None
        self._next_call_idx = 0
        self._book = _Book(caller, failures_kept)
        self._book.background = self.background_finalize
        self._finalizer: _Finalizer | None = None
        self._closed = False

    # ------------------------------------------------------------------ properties
    @property
    def sync(self) -> SyncGroup:
        """The ranks this queue synchronizes (created at first use)."""
        if self._sync is None:
            self._sync = SyncGroup(self._process_group)
        return self._sync

    @property
    def finalize_sync(self) -> SyncGroup:
        """The group the ``finalize_fns`` must use for their collectives: the
        finalizer's own gloo group with ``background_finalize`` (after :meth:`start`),
        else :attr:`sync`."""
        return self._finalizer.sync if self._finalizer is not None else self.sync

    @property
    def closed(self) -> bool:
        return self._closed

    def in_finalizer_thread(self) -> bool:
        """True in this queue's background finalizer thread (where its ``finalize_fns``
        and ``on_settled`` run): a blocking wait there for a call of this queue never
        returns, since this thread is the one that would settle it."""
        finalizer = self._finalizer
        return finalizer is not None and threading.current_thread() is finalizer.thread

    @property
    def next_call_idx(self) -> int:
        """The ``call_idx`` the next :meth:`schedule_async_request` will assign (a caller
        may register it first; scheduling is not thread-safe: one thread schedules)."""
        return self._next_call_idx

    def start(self) -> None:
        """Start the persistent worker and, with ``background_finalize``, the finalizer.

        Collective the first time with ``background_finalize`` (it creates the
        finalizer's gloo group); idempotent. Optional: the first
        :meth:`schedule_async_request` does it.

        Raises:
            InvalidStateError: (a ``RuntimeError``) the queue is closed.
        """
        if self._closed:
            raise InvalidStateError("AsyncCallsQueue is closed")
        if isinstance(self.caller, PersistentAsyncCaller):
            self.caller.start()
        if self.background_finalize and self._finalizer is None:
            self._finalizer = _Finalizer(self._book, SyncGroup.private(self._process_group))

    # ------------------------------------------------------------------ scheduling
    def schedule_async_request(self, async_request: AsyncRequest, *, on_settled: SettleCallback | None = None) -> int:
        """Run ``preload_fn`` here, then start ``async_fn`` in the background.

        Args:
            async_request: the request; it is frozen and given its ``call_idx``.
            on_settled: makes the call *owned*: ``on_settled(call_idx, exc_or_None)``
                runs once when it is settled (see :data:`SettleCallback`), however
                soon, and its outcome is the owner's to report: with
                ``background_finalize`` :meth:`maybe_finalize_async_calls` does not
                report it (the checkpoint layer completes its save handles this way).

        Returns:
            The ``call_idx`` of the call (0, 1, 2, ... per queue, equal on all ranks).

        Raises:
            InvalidStateError: (a ``RuntimeError``) the queue is closed.
            KeyboardInterrupt: (or any ``BaseException`` that is not an ``Exception``)
                interrupted the ``preload_fn``; the call is recorded as failed on this
                rank (reported on every rank by finalization), then it is re-raised.

        A ``preload_fn`` that raises an ``Exception`` does not raise here (other ranks
        would go on and diverge): the failure is recorded and reported on every rank.
        """
        if self._closed:
            raise InvalidStateError("AsyncCallsQueue is closed")
        if self.background_finalize and self._finalizer is None:
            self.start()
        call_idx = self._next_call_idx
        self._next_call_idx += 1
        request = async_request._replace(call_idx=call_idx).freeze()
        book = self._book
        with book.cond:
            book.pending[call_idx] = request
            if on_settled is not None:
                book.on_settled[call_idx] = on_settled
                book.owned.add(call_idx)
        started = False
        try:
            args = request.async_fn_args
            if request.preload_fn is not None:
                args = (request.preload_fn(),) + tuple(args)
            if request.async_fn is not None:
                self.caller.schedule(call_idx, request.async_fn, tuple(args), dict(request.async_fn_kwargs or {}))
                started = True
        except BaseException as exc:
            if not started:
                with book.cond:
                    book.preload_failures[call_idx] = RankFailure.from_exception(exc, "preload_fn raised ")
            if not isinstance(exc, Exception):
                self._hand_to_finalizer(call_idx)
                raise
        self._hand_to_finalizer(call_idx)
        return call_idx

    def _hand_to_finalizer(self, call_idx: int) -> None:
        if self._finalizer is not None:
            self._finalizer.work.put(call_idx)

    # ------------------------------------------------------------------ finalization
    def maybe_finalize_async_calls(
        self, blocking: bool = False, no_dist: bool = False, *, until: int | None = None
    ) -> list[int]:
        """Finalize the calls that finished on every rank, in ``call_idx`` order.

        Without ``background_finalize``: for the oldest pending call, the ranks
        exchange their local status (running, succeeded, failed) in one all_gather.
        If it succeeded everywhere its ``finalize_fns`` run; if it failed anywhere,
        every rank raises; otherwise (still running somewhere) this returns, unless
        ``blocking``. With ``background_finalize`` the finalizer thread did that:
        this only reports what it settled since the last call (no collective).

        Args:
            blocking: wait until every pending call (up to ``until``) is finalized.
            no_dist: decide on this rank's status alone, with no collective.
            until: finalize only calls with ``call_idx <= until``.

        Returns:
            The ``call_idx`` of each call finalized (since the last call, in the
            background mode), in order.

        Raises:
            InvalidArgumentError: (a ``ValueError``) ``no_dist=True`` on a
                ``background_finalize`` queue (ignored there).
            CheckpointException: the oldest pending call failed on some rank; the same
                exception (``call_idx`` and per-rank causes) on every rank. The call is
                dropped without running its finalize_fns; later calls stay pending.
                In the background mode, not blocking, a failure behind calls finalized
                since the last call is raised by the next call; blocking, it is raised now.
        """
        if self.background_finalize:
            if no_dist:
                raise InvalidArgumentError(
                    "no_dist=True cannot be combined with background_finalize=True: the "
                    "background finalizer decides on every rank's status, collectively"
                )
            return self._harvest(blocking, until)
        finalized: list[int] = []
        sync = None if no_dist else self.sync
        book = self._book
        while True:
            with book.cond:
                if not book.pending:
                    break
                call_idx, request = next(iter(book.pending.items()))
            if until is not None and call_idx > until:
                break
            status, cause = book.local_status(call_idx, request, blocking)
            statuses = [status] if sync is None else [s[0] for s in sync.all_gather_ints([status])]
            if _FAILED in statuses:
                if sync is None:
                    failures = {self.sync.rank: cause}
                else:
                    causes = sync.all_gather_object(cause)
                    failures = {r: c for r, c in enumerate(causes) if c is not None}
                exc = CheckpointException(call_idx, failures)
                if book.claim(call_idx) is not None:
                    book.settle(call_idx, exc)
                raise exc
            if all(s == _OK for s in statuses):
                if book.claim(call_idx) is None:
                    continue
                error = book.run_finalize(call_idx, request, self.sync.rank)
                book.settle(call_idx, error)
                if error is not None:
                    raise error
                finalized.append(call_idx)
                continue
            if not blocking:
                break
            time.sleep(0.001)  # only reachable if a rank's status changed under us
        return finalized

    def _harvest(self, blocking: bool, until: int | None) -> list[int]:
        book = self._book
        out: list[int] = []
        with book.cond:
            if blocking:

                def settled() -> bool:
                    return not book.unsettled(until)

                while not book.cond.wait_for(settled, timeout=1.0):
                    if self._finalizer is None or not self._finalizer.thread.is_alive():
                        break
            while book.unharvested:
                call_idx, exc = book.unharvested[0]
                if until is not None and call_idx > until:
                    break
                if exc is not None:
                    if out and not blocking:
                        break  # reported by the next call
                    # blocking: a failure behind calls that were finalized is raised now
                    # (returning would tell the caller that everything finalized).
                    book.unharvested.popleft()
                    raise exc
                book.unharvested.popleft()
                out.append(call_idx)
        if blocking and self._finalizer is not None and not self._finalizer.thread.is_alive():
            book.drop_all(self.sync.rank, "the background finalizer is not running", settler_gone=True)
        return out

    def get_result(self, call_idx: int) -> Any:
        """The return value of ``async_fn`` for ``call_idx``, on this rank.

        Available while the call's ``finalize_fns`` run (they take no arguments).

        Raises:
            KeyError: ``call_idx`` is not being finalized.
        """
        return self._book.results[call_idx]

    def get_failure(self, call_idx: int) -> CheckpointException | None:
        """The exception raised for ``call_idx``, if it failed recently, else ``None``."""
        with self._book.cond:
            return self._book.failures.get(call_idx)

    def is_pending(self, call_idx: int) -> bool:
        """True if ``call_idx`` was scheduled and is not finalized nor failed yet (also
        while its finalize_fns run)."""
        with self._book.cond:
            return call_idx in self._book.pending or call_idx in self._book.settling

    def wait_local(self, call_idx: int, timeout: float | None = None) -> bool:
        """Wait until this rank's ``async_fn`` for ``call_idx`` no longer runs.

        No collective. Used to reuse staging buffers only once the write that reads
        them is over (finished, failed, or its process died).

        Returns:
            True if it no longer runs, False on timeout (seconds).
        """
        return self.caller.wait(call_idx, timeout)

    def get_num_unfinalized_calls(self) -> int:
        """Number of scheduled calls not finalized yet (on this rank)."""
        with self._book.cond:
            return self._book.unsettled()

    # ------------------------------------------------------------------ shutdown
    def close(self, abort: bool = False) -> None:
        """Finalize pending calls (collectively, blocking) and stop the worker.

        Args:
            abort: do not finalize: terminate the worker or children at once (SIGTERM,
                grace period, SIGKILL) and drop the pending calls. No collective.

        Raises:
            CheckpointException: (``abort=False``) a pending call failed; the worker is
                stopped anyway and the remaining calls are still finalized.
            KeyboardInterrupt: interrupted while waiting; the queue is then closed
                with ``abort=True`` before the interrupt is re-raised.

        Idempotent: later calls do nothing. In a child of ``os.fork()`` it does nothing
        (the worker and the pending calls are the parent's).
        """
        if self._closed:
            return
        self._closed = True
        if self.caller.foreign:
            return  # a child of os.fork(): the pending calls and the worker are the parent's
        first_error: CheckpointException | None = None
        book = self._book
        try:
            if not abort:
                while True:
                    with book.cond:
                        if not book.unsettled() and not book.unharvested:
                            break
                    try:
                        self.maybe_finalize_async_calls(blocking=True)
                    except CheckpointException as exc:
                        first_error = first_error or exc
        except BaseException:
            abort = True  # interrupted (Ctrl-C): stop at once instead of waiting
            raise
        finally:
            if self._finalizer is not None:
                if abort:
                    self._finalizer.stop.set()
                self.caller.close(abort=abort)
                self._finalizer.close(timeout=1.0 if abort else None)
            else:
                self.caller.close(abort=abort)
            rank = self._sync.rank if self._sync is not None else 0
            book.drop_all(
                rank,
                "dropped by close(abort=True) before it was finalized",
                settler_gone=self._finalizer is None or not self._finalizer.thread.is_alive(),
            )
        if first_error is not None:
            raise first_error

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        try:
            pending = self.get_num_unfinalized_calls()
            if pending:
                _log.warning(
                    "an AsyncCallsQueue with %d unfinalized call(s) was dropped without close(): they are aborted",
                    pending,
                )
            self.close(abort=True)
        except Exception:  # noqa: BLE001 - nothing to report to at collection time
            pass

    def __enter__(self) -> AsyncCallsQueue:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(abort=exc_type is not None)
