"""Saver: runs the phases of each save on an AsyncCallsQueue and completes its handle.

One class over 600 lines, on purpose: its methods share one state lock and one order
of saves (scheduling, overlapped staging, settling, harvesting); the phases themselves
are in :mod:`asyncckpt.saving.phases`.

The life of a save's call is the queue's state machine (``_Book`` in
:mod:`asyncckpt.async_utils.calls_queue`: pending, settling, settled); the saver keeps
no state of its own about it. It schedules each save's call as *owned*, with an
``on_settled`` that runs once, in the settling-to-settled transition, and completes
the save's :class:`SaveHandle` (a ``concurrent.futures.Future``): a save is pending
exactly while its handle is not done. The saver keeps only the records of its saves
in call order until its owner's harvest (``CheckpointManager.maybe_finalize``) reported
them. docs/DESIGN.md, "the save's life".
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

from asyncckpt import _exit, _faults
from asyncckpt._hooks import call_timings_hooks
from asyncckpt.async_utils.calls_queue import AsyncCallsQueue
from asyncckpt.async_utils.request import AsyncRequest
from asyncckpt.dist import SyncGroup
from asyncckpt.errors import (
    CallbackError,
    CheckpointError,
    CheckpointException,
    CheckpointTimeoutError,
    InvalidStateError,
    RankFailure,
)
from asyncckpt.format.layout import RankLayout
from asyncckpt.io.storage import LOCAL, Storage
from asyncckpt.io.writer import RankWriteResult, WriteTask
from asyncckpt.options import SaveOptions
from asyncckpt.root import CheckpointRoot
from asyncckpt.saving.exchange import _LayoutCache, _LayoutExchange
from asyncckpt.saving.handle import SaveCallback, SaveHandle, SaveResult, SaveTimings
from asyncckpt.saving.overlap import _Overlapped, _small
from asyncckpt.saving.pending import _describe_save, _live_savers, _settle_or_name, name_unreported
from asyncckpt.saving.phases import (
    MetadataPickle,
    _committed_on_disk,
    commit,
    plan,
    stage,
    write_task,
)
from asyncckpt.saving.planning import PlanCache
from asyncckpt.saving.record import SaveInFlight
from asyncckpt.saving.staging import StagingBuffer, StagingCopier, StagingPool

_log = logging.getLogger("asyncckpt")

#: A saver keeps at most this many committed saves that no harvest
#: (``maybe_finalize``) has reported yet; beyond it the oldest are forgotten (down to
#: half of it at once), so that a loop that never calls ``maybe_finalize`` (a local
#: tier saved every step for days) does not keep one record per save forever (about
#: 5 KB each, measured). Failed saves are kept until reported.
MAX_UNHARVESTED = 1024

#: Per thread: the saves it is settling now (:meth:`Saver._settle`: the completion
#: callback runs there, before the handle is completed).
_settling = threading.local()


#: The lock the savers of one queue share (:attr:`Saver.lock`): one save, hand-off or
#: ``synchronize_staging()`` on the queue at a time, since a save of one saver may hand
#: off another's overlapped save (:meth:`Saver.hand_off_overlapped`).
_queue_locks: weakref.WeakKeyDictionary[AsyncCallsQueue, threading.RLock] = weakref.WeakKeyDictionary()
_queues_lock = threading.Lock()


def _lock_of(queue: AsyncCallsQueue) -> threading.RLock:
    with _queues_lock:
        lock = _queue_locks.get(queue)
        if lock is None:
            lock = _queue_locks[queue] = threading.RLock()
        return lock


def _renew_queues_lock() -> None:
    global _queues_lock
    _queues_lock = threading.Lock()  # a child of os.fork(): another thread may have held it


os.register_at_fork(after_in_child=_renew_queues_lock)


def _settling_here() -> list[SaveInFlight]:
    records: list[SaveInFlight] | None = getattr(_settling, "records", None)
    if records is None:
        records = _settling.records = []
    return records


class _SaveLink:
    """The :class:`~asyncckpt.saving.handle.SaveDriver` of one save: what its handle
    asks of the saver (the handle imports nothing of this module)."""

    def __init__(self, saver: Saver) -> None:
        self._saver = saver
        self.record: SaveInFlight | None = None  # set once planned

    @property
    def call_idx(self) -> int | None:
        return self.record.call_idx if self.record is not None else None

    def synchronize_staging(self) -> None:
        overlapped = self._saver._overlapped
        if overlapped is not None and self.record is not None and overlapped.save is self.record:
            self._saver.synchronize_staging()

    def drive(self, timeout: float | None) -> None:
        if self.record is not None:
            self._saver.drive_foreground(self.record, timeout)

    def reported(self) -> None:
        if self.record is not None:
            self.record.reported = True

    def waits_on_itself(self) -> bool:
        record = self.record
        if record is not None and any(r is record for r in _settling_here()):
            return True  # its completion callback runs in this thread, before the handle completes
        queue = self._saver.live_queue()
        return queue is not None and queue.background_finalize and queue.in_finalizer_thread()

    def check_callbacks(self, error: BaseException | None) -> None:
        if error is None:
            self._saver.raise_callback_errors()
        elif isinstance(error, CheckpointException):
            self._saver.attach_callback_errors(error)


class Saver:
    """Runs the save phases on one queue for one owner (a manager, or ``asyncckpt.save``).

    Owns: a :class:`StagingPool` (freed by :meth:`release`), a copier, the plan,
    layout and ``.metadata`` caches, and the records of its saves until harvested.
    Each save's call is owned (``on_settled``): when the queue settles it, on every
    rank, whichever thread settled it, the saver runs the completion callback, for
    a failed save the coordinator removes its temporary directory (so a failed save
    leaves nothing behind; another rank never removes what the coordinator may
    commit), then completes the handle (also when one of those steps raised).

    Args:
        queue: the queue that runs the writes (held weakly: the saver goes with it).
        options: staging and writing options.
        root: the checkpoint root of a ``CheckpointManager`` (``latest``, retention).
        storage: the tier its saves are written to (default the local file system).
    """

    def __init__(
        self,
        queue: AsyncCallsQueue,
        options: SaveOptions | None = None,
        root: CheckpointRoot | None = None,
        storage: Storage = LOCAL,
    ) -> None:
        self.options = options or SaveOptions()
        self.storage = storage
        self._queue_ref = weakref.ref(queue)
        self.root = root
        self.pool = StagingPool(self.options.staging_buffers)
        self.copier = StagingCopier(self.options.copy_threads)
        self.plan_cache: PlanCache | None = PlanCache() if self.options.plan_cache else None
        self.layouts = _LayoutCache()
        self.layout_exchange = _LayoutExchange()  # used by the finalizer thread's commits only
        self.metadata_pickle = MetadataPickle()  # this saver's: another saver's commits never evict it
        #: One save() / synchronize_staging() at a time, shared by the queue's savers.
        self.lock = _lock_of(queue)
        self._state = threading.RLock()  # guards the two below (training and finalizer threads)
        self._overlapped: _Overlapped | None = None
        #: This saver's scheduled saves, in call order, until harvested (pending while
        #: their handle is not done: the queue's state, not a copy of it).
        self._records: collections.deque[SaveInFlight] = collections.deque()
        self._callback_errors: list[tuple[SaveHandle, BaseException]] = []
        #: Timings of the most recently committed save (``None`` before the first).
        self.last_committed_timings: SaveTimings | None = None
        self._pid = os.getpid()  # a forked child never frees its parent's buffers
        _live_savers.add(self)

    @property
    def queue(self) -> AsyncCallsQueue:
        queue = self._queue_ref()
        if queue is None:
            raise InvalidStateError("the AsyncCallsQueue of this saver was garbage-collected")
        return queue

    def live_queue(self) -> AsyncCallsQueue | None:
        """The queue, ``None`` once it was garbage-collected."""
        return self._queue_ref()

    def overlapped_record(self) -> SaveInFlight | None:
        """The overlapped save whose staging is not handed to the writer yet, else ``None``."""
        overlapped = self._overlapped
        return overlapped.save if overlapped is not None else None

    def set_options(self, options: SaveOptions) -> None:
        """Use ``options`` for the next saves (the pool grows or shrinks lazily)."""
        self.options = options
        self.pool.num_buffers = options.staging_buffers
        if options.copy_threads != self.copier.threads:
            self.copier.close()
            self.copier = StagingCopier(options.copy_threads)
        if options.plan_cache and self.plan_cache is None:
            self.plan_cache = PlanCache()
        elif not options.plan_cache:
            self.plan_cache = None

    def pending_records(self) -> list[SaveInFlight]:
        """This saver's saves scheduled and not settled yet, in call order."""
        with self._state:
            return [record for record in self._records if not record.handle.done()]

    def _in_flight(self, final_dir: Path) -> bool:
        """True while a save of this saver into ``final_dir`` is scheduled and not settled."""
        return any(record.final_dir == final_dir for record in self.pending_records())

    def pending_steps(self) -> list[int]:
        """Steps of this saver's saves scheduled and not settled yet."""
        return [s.step for s in self.pending_records() if s.step is not None]

    def _forget_unharvested(self) -> None:
        """(holding ``_state``) Forget the oldest committed saves that no harvest has
        reported, down to half of :data:`MAX_UNHARVESTED` records; pending and failed
        ones stay (a failure is still raised, in order)."""
        excess = len(self._records) - MAX_UNHARVESTED // 2
        kept: collections.deque[SaveInFlight] = collections.deque()
        for record in self._records:
            if excess > 0 and record.handle.done() and record.handle.exception(timeout=0) is None:
                excess -= 1
                continue
            kept.append(record)
        self._records = kept

    def _owns(self, call_idx: int) -> bool:
        """True if ``call_idx`` of the queue is a save of this saver not harvested yet."""
        with self._state:
            return any(record.call_idx == call_idx for record in self._records)

    # ------------------------------------------------------------------ phases, driven
    def _check_memory(self, layout: RankLayout, reserve: bool = False) -> None:
        """The memory guard (``SaveOptions.staging_memory_limit``), before any allocation;
        ``reserve``: for ``prepare()``, which allocates every staging buffer at once.

        Raises:
            CheckpointError: a new staging buffer would take more than the allowed
                fraction of the memory available (funnelled to every rank by the plan).
        """
        limit = self.options.staging_memory_limit
        if limit is None:
            return
        need = self._staging_need(layout, reserve)
        if not need:
            return  # a buffer is reused: nothing to allocate (the steady state)
        available = psutil.virtual_memory().available
        if need > limit * available:
            raise CheckpointError(
                f"staging this rank's state needs a new host buffer of {need:,} bytes, more than "
                f"{limit:g} x the {available:,} bytes of memory available; free memory, use fewer "
                "staging_buffers, or pass SaveOptions(staging_memory_limit=None) to skip this check"
            )

    def _staging_need(self, layout: RankLayout, reserve: bool) -> int:
        """The bytes of host memory staging ``layout`` would allocate now (0: a buffer is
        reused); ``reserve``: every buffer ``prepare()`` allocates."""
        if reserve:
            return self.pool.bytes_to_reserve(layout.slab_nbytes)
        return self.pool.bytes_to_allocate(layout.slab_nbytes, self.queue.caller.is_running)

    def _buffer_for(self, save: SaveInFlight) -> StagingBuffer:
        queue = self.queue
        return self.pool.acquire(
            save.layout.slab_nbytes, save.layout.key, queue.caller.is_running, lambda idx: queue.wait_local(idx)
        )

    def save(
        self,
        state_dict: dict[str, Any],
        checkpoint_dir: str | os.PathLike,
        *,
        async_op: bool,
        process_group: Any,
        coordinator_rank: int,
        step: int | None = None,
        callback: SaveCallback | None = None,
        user_info: dict[str, Any] | None = None,
        share: tuple[int, ...] = (),
        on_shared: Callable[[list[list[int]]], None] | None = None,
    ) -> SaveHandle:
        """Save ``state_dict`` (see :func:`asyncckpt.save`); the caller holds :attr:`lock`.
        ``user_info``: extra manifest fields (``metrics``, ``metadata``), already checked.
        ``share`` / ``on_shared``: ints every rank receives from every rank, through the
        plan's first collective (:func:`~asyncckpt.saving.planning.plan_save`).

        In an atexit handler (:func:`asyncckpt._exit.in_atexit_handler`) every save is
        synchronous, as a ``torch.save`` there: the exit would not wait for it past
        ``ASYNCCKPT_EXIT_TIMEOUT_S``, or (a handler registered before asyncckpt's) has
        already stopped waiting. After the exit's phases ran, their cleaning runs again.
        """
        at_exit = _exit.in_atexit_handler()
        try:
            return self._save(
                state_dict,
                checkpoint_dir,
                async_op and not at_exit,
                process_group,
                coordinator_rank,
                step,
                callback,
                user_info,
                share,
                on_shared,
            )
        finally:
            if at_exit:
                _exit.clean_up_again()

    def _save(
        self,
        state_dict: dict[str, Any],
        checkpoint_dir: str | os.PathLike,
        async_op: bool,
        process_group: Any,
        coordinator_rank: int,
        step: int | None,
        callback: SaveCallback | None,
        user_info: dict[str, Any] | None = None,
        share: tuple[int, ...] = (),
        on_shared: Callable[[list[list[int]]], None] | None = None,
    ) -> SaveHandle:
        started = time.monotonic()
        self.hand_off_overlapped()  # an earlier overlapped save is scheduled first
        final_dir = Path(checkpoint_dir).absolute()
        queue = self.queue
        if async_op:
            queue.start()  # collective the first time: the finalizer's group
            self.wait_for_room()
        sync = SyncGroup(process_group)
        link = _SaveLink(self)
        handle = SaveHandle(final_dir, step, link)
        record = plan(
            state_dict,
            final_dir,
            handle,
            sync=sync,
            coordinator_rank=coordinator_rank,
            step=step,
            root=self.root,
            cache=self.plan_cache,
            layouts=self.layouts,
            check_layout=self._check_memory,
            in_flight=self._in_flight,
            storage=self.storage,
            share=share,
            on_shared=on_shared,
        )
        record.started, record.callback = started, callback
        record.user_info = dict(user_info or {})
        link.record = record
        if not async_op:
            self._save_sync(record, started)
            return handle
        self._begin_staging(record)
        record.stall_s += time.monotonic() - started
        return handle

    def _begin_staging(self, record: SaveInFlight) -> None:
        """Stage ``record`` and hand it to the queue: overlapped with training
        (``overlap_staging``: :meth:`_start_overlapped`), else copied now and scheduled.
        The caller holds :attr:`lock`."""
        if self.options.overlap_staging:
            self._start_overlapped(record)
        else:
            self._schedule(record, lambda: self._stage_now(record))

    def _start_overlapped(self, record: SaveInFlight) -> None:
        """Stage ``record`` overlapped with training (``overlap_staging``): its D2H copies
        are issued here (ordered after this thread's current stream, they run
        asynchronously), its small CPU tensors copied now, the large ones in a thread;
        its call is scheduled when the copy is over (:meth:`synchronize_staging`). The
        caller holds :attr:`lock` and has handed off any earlier overlapped save of the
        queue (:meth:`hand_off_overlapped`)."""
        buffer = self._buffer_for(record)
        stage(record, buffer, self.copier, cpu=False, synchronize=False)
        stage(record, buffer, self.copier, cuda=False, synchronize=False, select=_small, blobs=False)
        self._overlapped = _Overlapped(
            record,
            lambda: stage(record, buffer, self.copier, cuda=False, synchronize=False, select=lambda t: not _small(t)),
            self.copier.event,
        )

    def _stage_now(self, record: SaveInFlight) -> WriteTask:
        buffer = self._buffer_for(record)
        try:
            stage(record, buffer, self.copier)
        finally:
            record.planned.data.clear()  # drop references to the user's tensors
        return write_task(record, self.pool, self.options)

    def _schedule(self, record: SaveInFlight, preload: Any) -> None:
        """Schedule ``record``'s call, owned: :meth:`_settle` completes its handle.

        Raises:
            CheckpointError: another thread scheduled on the queue at the same time
                (the save's commit would read another call's result: it fails).
            RuntimeError: the queue is closed (the handle fails with it).
        """
        self.hand_off_overlapped()  # the queue's calls in the order of the saves (an earlier one first)
        queue = self.queue
        request = AsyncRequest(record.storage.write_rank, (), [lambda: self._commit_call(record)], preload_fn=preload)
        # Known before it is scheduled: the commit may run before schedule_async_request
        # returns (it hands the call to the finalizer thread first).
        call_idx = queue.next_call_idx
        record.call_idx = call_idx
        with self._state:
            self._records.append(record)
            if len(self._records) > MAX_UNHARVESTED:
                self._forget_unharvested()
        try:
            scheduled = queue.schedule_async_request(request, on_settled=functools.partial(self._on_settled, record))
        except BaseException as exc:
            if queue.next_call_idx == call_idx:  # never scheduled: nothing will settle it
                with self._state:
                    self._records.remove(record)
                record.call_idx = None
                self._settle(
                    record,
                    CheckpointError(
                        f"the save of {_describe_save(record)} was not scheduled: {type(exc).__name__}: {exc}"
                    ),
                )
            raise
        if scheduled != call_idx:
            raise CheckpointError(
                f"the save of {_describe_save(record)} was scheduled as call {scheduled} of its queue, not "
                f"{call_idx}: another thread scheduled on the same AsyncCallsQueue at the same time. Schedule "
                "on one queue from one thread (this save fails at its commit)"
            )
        if record.buffer is not None:
            self.pool.lease(record.buffer, call_idx)

    def _commit_call(self, record: SaveInFlight) -> None:
        """The finalize function of a save's call: phase 4 on the finalizer's group."""
        queue = self.queue
        if record.call_idx is None:
            raise CheckpointError(f"the save of {_describe_save(record)} was committed before it was scheduled")
        result: RankWriteResult = queue.get_result(record.call_idx)
        commit(
            record,
            result,
            queue.finalize_sync,
            [s for s in self.pending_steps() if s != record.step],
            self.layout_exchange,
            self.metadata_pickle,
        )

    def _save_sync(self, record: SaveInFlight, started: float) -> None:
        """A synchronous save: the same phases in this thread, after the pending saves.

        Interrupted (Ctrl-C, or a broken collective), the save is settled as failed
        and its temporary directory removed where no rank can commit it any more:
        always on the coordinator (it alone commits, and it is interrupted), on the
        other ranks never (the coordinator may still commit them). Then the interrupt
        is re-raised.
        """
        sync = record.sync
        failure: RankFailure | None = None
        result: RankWriteResult | None = None
        try:
            self.wait_all()  # commits stay in call order: `latest` never goes backwards
            try:
                result = record.storage.write_rank(self._stage_now(record))
            except Exception as exc:  # noqa: BLE001 - funnelled to every rank
                failure = RankFailure.from_exception(exc)
            record.stall_s += time.monotonic() - started
            error: CheckpointException | None = None
            failures = sync.gather_failures(failure)
            if failures:
                error = CheckpointException(-1, failures, record.step, record.final_dir)
            else:
                assert result is not None
                try:
                    commit(record, result, sync, self.pending_steps(), metadata_pickle=self.metadata_pickle)
                except CheckpointException as exc:
                    error = exc
        except BaseException as exc:
            if result is not None and _committed_on_disk(record, result, started) is not None:
                self._settle(record, None)  # interrupted after the commit point: committed, as on disk
                raise
            interrupted = CheckpointException(
                -1, {sync.rank: RankFailure.from_exception(exc, "interrupted: ")}, record.step, record.final_dir
            )
            self._settle(record, interrupted)  # the coordinator removes its files: it did not commit
            raise
        self._settle(record, error)
        if error is not None:
            record.reported = True
            self.attach_callback_errors(error)
            raise error
        self.raise_callback_errors()

    def prepare(self, state_dict: dict[str, Any], process_group: Any, coordinator_rank: int) -> int:
        """Plan ``state_dict`` and allocate and format its staging buffers (all
        ``SaveOptions.staging_buffers`` of them, so that no later save allocates one),
        writing nothing.

        Returns:
            The bytes of host memory the staging buffers hold.
        """
        with self.lock:
            self.synchronize_staging()
            sync = SyncGroup(process_group)
            handle = SaveHandle(Path(""), None)
            record = plan(
                state_dict,
                Path(""),
                handle,
                sync=sync,
                coordinator_rank=coordinator_rank,
                cache=self.plan_cache,
                layouts=self.layouts,
                check_target=False,
                check_layout=lambda layout: self._check_memory(layout, reserve=True),
            )
            queue = self.queue
            buffers = self.pool.reserve(
                record.layout.slab_nbytes, record.layout.key, queue.caller.is_running, queue.wait_local
            )
            cuda = any(isinstance(d, torch.Tensor) and d.is_cuda for d in record.planned.data)
            for buffer in buffers:
                buffer.populate(self.copier)  # the allocation a first save would pay
                buffer.format(record.layout)
                if cuda:
                    buffer.pin()
            return sum(b.nbytes for b in self.pool.buffers)

    def staging_copied(self) -> bool:
        """Whether an overlapped save's copy is over (True with none), polled: never
        waits (:meth:`_Overlapped.copied`).

        On a queue finalized in the training loop (no background finalizer) the
        answer is collective, whether the copy is over on every rank (one all_gather
        of the queue's group while an overlapped save is pending, which it is on
        every rank alike): that queue's calls are finalized by collectives over the
        calls each rank scheduled, so every rank must hand the save to the writer in
        the same ``maybe_finalize``."""
        overlapped = self._overlapped
        if overlapped is None:
            return True
        copied = overlapped.copied()
        queue = self._queue_ref()
        if queue is None or queue.background_finalize or queue.closed:
            return copied
        return all(flag for (flag,) in queue.sync.all_gather_ints([int(copied)]))

    def release_staging(self) -> None:
        """The training loop's ``synchronize_staging()``: once it returns, the saved state
        may change. An overlapped save's CPU copies are joined; its D2H copies, if still
        running, are ordered before the current CUDA stream's later work on the device
        (:meth:`_Overlapped.order_before_update`: the host does not wait for the
        device), and its write starts at the first :meth:`staging_copied` poll that finds
        them over (``maybe_finalize``), or at the next save, wait or close. A copy that is
        over is handed to the writer now (:meth:`synchronize_staging`). On a queue
        finalized in the training loop the copy is waited for and handed off now, on
        every rank alike (whether it is over differs between ranks; see
        :meth:`staging_copied`)."""
        with self.lock:
            pending = self._overlapped
            if pending is None:
                return
            queue = self._queue_ref()
            if queue is not None and not queue.background_finalize:
                self.synchronize_staging()
                return
            started = time.monotonic()
            pending.order_before_update()
            if not pending.copied():
                pending.save.stall_s += time.monotonic() - started
                return
            self.synchronize_staging()

    def hand_off_overlapped(self) -> None:
        """Hand the overlapped save of this saver's queue that is not handed to the
        writer yet, of this saver or another saver of the queue, to the writer: before
        any save on the queue plans or is scheduled.

        Every rank must schedule a queue's calls in the same order, but an overlapped
        save is handed off when its copy is over, which differs from rank to rank. So
        a queue has at most one overlapped save not handed off, and any save on the
        queue (a manager's, its local tier's, :func:`asyncckpt.save`'s with the same
        ``calls_queue``) hands it off first: calls are scheduled in the order of the
        saves, on every rank."""
        queue = self._queue_ref()
        with self.lock:
            for saver in [self, *_live_savers]:  # (the exit forgets the live savers: this one still counts)
                if isinstance(saver, Saver) and saver._overlapped is not None and saver.live_queue() is queue:
                    saver.synchronize_staging()

    def synchronize_staging(self) -> None:
        """Finish an overlapped staging and schedule its write (see ``SaveHandle``)."""
        with self.lock:
            pending, self._overlapped = self._overlapped, None
            if pending is None:
                return
            started = time.monotonic()
            record = pending.save

            def preload() -> WriteTask:  # joins the copy; runs inside schedule_async_request
                try:
                    pending.wait_copied()  # compares the versions
                    self.copier.synchronize()
                    if pending.error is not None:
                        raise pending.error
                finally:
                    record.planned.data.clear()
                    pending.watched = []
                return write_task(record, self.pool, self.options)

            try:
                self._schedule(record, preload)
            finally:
                record.stall_s += time.monotonic() - started

    # ------------------------------------------------------------------ outcomes
    def _on_settled(self, record: SaveInFlight, call_idx: int, exc: CheckpointException | None) -> None:
        """The ``on_settled`` of a save's call: the queue runs it once (any thread, every rank)."""
        self._settle(record, exc)

    def _settle(self, record: SaveInFlight, exc: BaseException | None) -> None:
        """Run what a save's end needs, then complete its handle, whatever raised.

        A failed save's temporary directory is removed by the coordinator; the
        completion callback runs (its error is kept for :meth:`raise_callback_errors`);
        then the handle is completed: with the save's result or failure, or, if one of
        these steps raised, with a :class:`CheckpointException` caused by that error
        (failpoint ``settle``). Never leaves the handle pending.
        """
        handle = record.handle
        outcome: SaveResult | BaseException | None = None
        interrupt: BaseException | None = None
        settling = _settling_here()
        settling.append(record)  # a wait() on it in this thread (its callback) raises, never deadlocks
        try:
            _faults.hit("settle")
            if isinstance(exc, CheckpointException):  # named by the step and path, not the queue's call
                exc = exc.for_save(record.step, record.final_dir)
            if exc is not None:
                outcome = exc
                if record.sync.rank == record.coordinator_rank:
                    # The coordinator alone, once it decided not to commit: another rank
                    # must never remove what the coordinator may still be committing.
                    record.storage.discard(record.tmp_dir)
            else:
                if record.timings is None:
                    raise CheckpointError(f"the save of {_describe_save(record)} was settled without its timings")
                outcome = SaveResult(record.final_dir, record.step, record.timings, record.timings.bytes)
                self.last_committed_timings = record.timings
                _report_timings(record, record.timings)
            self._run_callback(record, outcome)
        except BaseException as error:  # noqa: BLE001 - the handle is completed with it below
            if not isinstance(error, Exception):
                interrupt = error
            done = "failed" if exc is not None else "was written"
            outcome = CheckpointException(
                record.call_idx if record.call_idx is not None else -1,
                {record.sync.rank: RankFailure.from_exception(error, f"settling the save ({done}) raised ")},
                record.step,
                record.final_dir,
            )
            outcome.__cause__ = error
        finally:
            settling.pop()  # LIFO: a callback that settles another save has finished it
            record.planned = record.planned._replace(data=[])
            # A handle the user keeps (a global of the training script) holds its record:
            # it must not hold the process group's gloo group to interpreter finalization.
            record.sync.forget_group()
            if isinstance(outcome, SaveResult):
                handle.set_result(outcome)
            else:  # never None here: every path above set it
                handle.set_exception(
                    outcome or CheckpointError(f"the save of {_describe_save(record)} was settled without an outcome")
                )
        if interrupt is not None:
            raise interrupt

    def _run_callback(self, record: SaveInFlight, outcome: SaveResult | BaseException) -> None:
        callback, record.callback = record.callback, None
        if callback is None:
            return
        try:
            callback(outcome)
        except Exception as error:  # noqa: BLE001 - reported by raise_callback_errors, never swallowed
            _log.error("the completion callback of the save of %s raised", record.final_dir, exc_info=error)
            with self._state:
                self._callback_errors.append((record.handle, error))

    def drive_foreground(self, record: SaveInFlight, timeout: float | None) -> None:
        """Finalize up to ``record``'s call on a queue finalized in the training loop
        (collective; commits); no-op in the background. A failure of an earlier save
        of this saver is left to its handle; one of another call of the queue (not a
        save of this saver) is raised.

        Raises:
            CheckpointTimeoutError: (a ``TimeoutError``) this rank's write did not finish
                within ``timeout`` seconds.
            CheckpointException: an earlier call of the queue, not a save of this
                saver, failed.
        """
        queue = self._queue_ref()
        call_idx = record.call_idx
        if queue is None or queue.background_finalize or call_idx is None:
            return
        if timeout is not None and not queue.wait_local(call_idx, timeout):
            raise CheckpointTimeoutError(f"the write of {record.final_dir} did not finish within {timeout} s")
        while queue.is_pending(call_idx):
            try:
                queue.maybe_finalize_async_calls(blocking=True, until=call_idx)
            except CheckpointException as exc:
                if not self._owns(exc.call_idx):
                    raise

    def wait_for_room(self) -> None:
        """Backpressure: wait while ``staging_buffers + 1`` saves of this saver are
        scheduled and not settled (written or being written, not committed yet), until
        the oldest settles (its outcome is its handle's, as ever).

        The staging buffers bound the saves being *written* (a save waits for a buffer
        no write reads); this bounds those written and waiting for their commit, whose
        files are on disk (on a RAM disk for the local tier) meanwhile: a commit slower
        than the saves (a slow rename or fsync on a shared file system, the local
        tier's replication over a slow network) would otherwise add one step's bytes
        per save, without bound. As Orbax's ``save`` waits for the previous one, and a
        user of DCP's ``async_save`` for its future. Only with a background finalizer
        (the manager's and :func:`asyncckpt.save`'s queue), and never from its thread
        (a completion callback that saves): there the wait would be for itself, and
        a queue finalized in the training loop commits only when the loop asks.
        """
        queue = self._queue_ref()
        if queue is None or not queue.background_finalize or queue.in_finalizer_thread():
            return
        room = self.options.staging_buffers + 1
        while True:
            pending = self.pending_records()
            if len(pending) < room:
                return
            concurrent.futures.wait([pending[0].handle])

    def wait_all(self) -> None:
        """Wait until every save of this saver is settled (no error of a save raised here)."""
        self.synchronize_staging()
        for record in self.pending_records():
            self.drive_foreground(record, None)
            concurrent.futures.wait([record.handle])

    def harvest(self, blocking: bool) -> list[SaveInFlight]:
        """The saves committed since the last harvest, in order; raises the first failure
        not reported yet (``CheckpointManager.maybe_finalize``). Not blocking, a failure
        behind committed saves is left for the next harvest; blocking, it is raised now
        (a note names the committed steps). Callback errors are left for
        :meth:`raise_callback_errors`.

        With a queue finalized in the training loop this first finalizes (collective);
        a failure of a call of that queue that is not a save of this saver is raised.
        """
        queue = self._queue_ref()
        if queue is not None and not queue.background_finalize and not queue.closed:
            try:
                queue.maybe_finalize_async_calls(blocking=blocking)
            except CheckpointException as exc:
                if not self._owns(exc.call_idx):
                    raise  # not a save of this saver: nobody else would report it
        if blocking:
            self.wait_all()
        committed: list[SaveInFlight] = []
        failure: BaseException | None = None
        with self._state:
            while self._records:
                record = self._records[0]
                if not record.handle.done():
                    break
                error = record.handle.exception(timeout=0)
                if error is not None and not record.reported:
                    if committed and not blocking:
                        break  # raised by the next harvest, in order
                    # blocking (the end of training): raised now, whatever committed before
                    self._records.popleft()
                    failure = error
                    break
                self._records.popleft()
                if error is None and not record.reported:
                    committed.append(record)
        if failure is not None:
            if committed:
                steps = ", ".join(str(r.step) if r.step is not None else str(r.final_dir) for r in committed)
                failure.add_note(f"committed before this failure and reported with it: {steps}")
            self.attach_callback_errors(failure)
            raise failure
        return committed

    def attach_callback_errors(self, exc: BaseException) -> None:
        """Report the pending callback errors as notes of ``exc`` (which is raised instead)."""
        with self._state:
            errors, self._callback_errors = self._callback_errors, []
        for handle, error in errors:
            exc.add_note(
                f"the completion callback of the save of {handle.checkpoint_dir} also raised "
                f"{type(error).__name__}: {error}"
            )

    def raise_callback_errors(self) -> None:
        """Raise :class:`CallbackError` for the callbacks that raised since the last call."""
        with self._state:
            errors, self._callback_errors = self._callback_errors, []
        if not errors:
            return
        lines = [f"{h.checkpoint_dir} (committed): {type(e).__name__}: {e}" for h, e in errors]
        raise CallbackError("a completion callback raised: " + "; ".join(lines), [e for _, e in errors]) from errors[0][
            1
        ]

    def busy(self) -> bool:
        """True while a save of this saver is being staged (overlapped) or is pending."""
        return self._overlapped is not None or bool(self.pending_records())

    def settle_within(self, timeout: float, when: str) -> list[SaveInFlight]:
        """Let the pending saves settle for up to ``timeout`` seconds, then name on
        logger ``asyncckpt`` each one still pending (lost unless the caller waits on)
        and each one that failed, also earlier failures not reported yet (no
        ``maybe_finalize`` since). An overlapped save still copying is handed to the
        writer first. Saves of a queue finalized in the training loop cannot settle
        without the loop: they are named at once.

        Args:
            timeout: seconds to wait, in all.
            when: the occasion, for the messages ("at interpreter exit").

        Returns:
            The saves still pending.
        """
        try:
            self.synchronize_staging()
        except Exception:  # noqa: BLE001 - its failure is reported through its handle
            pass
        queue = self._queue_ref()
        background = queue is not None and queue.background_finalize and not queue.closed
        pending = self.pending_records()
        lost = _settle_or_name([(background, record) for record in pending], timeout, when)
        named = {id(record) for record in pending}
        # Failed before, never reported (no maybe_finalize since): named too.
        name_unreported([(r, exc) for r, exc in self.unreported_failures() if id(r) not in named], when)
        return lost

    def unreported_failures(self) -> list[tuple[SaveInFlight, BaseException]]:
        """This saver's saves that failed and whose failure nobody was told of (no
        ``wait()``, no harvest since), with their failures, in call order."""
        with self._state:
            return [
                (record, exc)
                for record in self._records
                if record.handle.done() and not record.reported and (exc := record.handle.exception(timeout=0))
            ]

    def free_idle_buffers(self) -> None:
        """(caller holds :attr:`lock`; nothing pending) Free the staging buffers, keeping
        the copy threads and the plan caches: a later save allocates a buffer again."""
        if os.getpid() != self._pid:
            return
        queue = self._queue_ref()
        self.pool.release_all(queue.caller.is_running if queue is not None else None)

    def release(self) -> None:
        """Free the staging buffers and stop listening to the queue; never blocks on a
        write (a buffer a write may still read is closed here but its memory is left
        to that write's process). An overlapped save not handed to the writer yet is
        dropped: its handle fails. In a child of ``os.fork()`` it does nothing: the
        buffers are the parent's (truncating a memfd there would free the parent's
        memory under its mapping)."""
        if os.getpid() != self._pid:
            return
        pending, self._overlapped = self._overlapped, None
        if pending is not None:
            pending.wait_copied()  # optimizers stop waiting for it
            record = pending.save
            record.planned.data.clear()
            self._settle(
                record,
                CheckpointError(
                    f"the save of {_describe_save(record)} was dropped before it was handed to the writer (its "
                    "manager was closed with abort=True or released before synchronize_staging()); it is not saved"
                ),
            )
        self.copier.close()
        queue = self._queue_ref()
        self.pool.release_all(queue.caller.is_running if queue is not None else None)
        self.layouts.clear()


def _report_timings(record: SaveInFlight, t: SaveTimings) -> None:
    """A committed save's timings: one INFO line on the coordinator (logger
    ``"asyncckpt"``), then the timings hooks (every rank; a hook's error is logged)."""
    if record.sync.rank == record.coordinator_rank and _log.isEnabledFor(logging.INFO):
        name = f"step {record.step} ({record.final_dir})" if record.step is not None else str(record.final_dir)
        _log.info(
            "asyncckpt: saved %s: plan %.3f s, stage %.3f s, stall %.3f s, write %.3f s, commit %.3f s, "
            "finalize %.3f s, total %.3f s, %d bytes at %.3f GB/s",
            name,
            t.plan_s,
            t.stage_s,
            t.stall_s,
            t.write_s,
            t.commit_s,
            t.finalize_s,
            t.total_s,
            t.bytes,
            t.gbps,
        )
    call_timings_hooks(t, record.step, record.final_dir)
