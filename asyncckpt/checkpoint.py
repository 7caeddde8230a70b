"""The user-facing checkpoint layer: ``save``, ``load``, ``verify``, ``CheckpointManager``.

One entry point saves synchronously or asynchronously (``async_op``, as proposed in
pytorch/pytorch#127191). An asynchronous save is an :class:`AsyncRequest` whose

- ``preload_fn`` stages this rank's data into a reused shared host buffer (the only
  time the training loop is blocked),
- ``async_fn`` writes and fsyncs this rank's data files in the background
  (:func:`asyncckpt.storage.writer.write_rank_files`, torch-free),
- ``finalize_fns`` gather every rank's write results and let the coordinator commit:
  DCP ``.metadata``, manifest, atomic rename, then ``latest`` and retention.

The format is torch.distributed.checkpoint's: stock ``dcp.load`` reads it.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import shutil
import threading
import time
import traceback
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException as _DcpCheckpointException
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

from .callers import PersistentAsyncCaller
from .calls_queue import AsyncCallsQueue
from .dist import SyncGroup
from .errors import CallbackError, CheckpointError, CheckpointException, CorruptCheckpointError
from .planning import PlanCache, plan_save
from .request import AsyncRequest
from .staging import HostSlab, Stager, StagingCopier
from .storage import commit as _commit
from .storage.layout import RankLayout, build_layout
from .storage.reader import SafeFileSystemReader, SafeLoadPlanner
from .storage.writer import RankWriteResult, WriteTask, current_umask, write_rank_files

__all__ = ["save", "load", "verify", "SaveHandle", "SaveTimings", "SaveResult", "SaveCallback", "CheckpointManager"]

_log = logging.getLogger("asyncckpt")


class SaveTimings(NamedTuple):
    """Timings of one save, measured at completion (DESIGN.md: known failure 9).

    Attributes:
        stall_s: seconds the calling thread was blocked in ``save()`` (planning +
            staging copy + scheduling).
        write_s: seconds the slowest rank spent writing and fsyncing its files.
        finalize_s: seconds of the commit (metadata, manifest, rename, ``latest``).
        total_s: seconds from the ``save()`` call until committed.
        bytes: bytes written by all ranks (data files, metadata, manifest excluded).
        gbps: ``bytes / write_s / 1e9`` (GB/s, decimal).
    """

    stall_s: float
    write_s: float
    finalize_s: float
    total_s: float
    bytes: int
    gbps: float


class SaveResult(NamedTuple):
    """What a completion callback receives for a committed save.

    Attributes:
        path: the committed checkpoint directory.
        step: the step (``CheckpointManager`` saves), else ``None``.
        timings: the save's :class:`SaveTimings`.
        bytes: bytes written by all ranks (``timings.bytes``).
    """

    path: Path
    step: int | None
    timings: SaveTimings
    bytes: int


#: A completion callback: called once, in the training process, after finalize,
#: with the :class:`SaveResult` of a committed save or the exception of a failed one.
SaveCallback = Callable[["SaveResult | BaseException"], None]


class SaveHandle:
    """A future-like handle of one save.

    Attributes:
        checkpoint_dir: the final (committed) path.
        call_idx: the call in the queue (``None`` for a synchronous save, and for an
            overlapped save until :meth:`synchronize_staging`).
        step: the step (``CheckpointManager`` saves), else ``None``.
        timings: :class:`SaveTimings` once committed, else ``None``.
    """

    def __init__(self, checkpoint_dir: Path, call_idx: int | None, queue: AsyncCallsQueue | None,
                 step: int | None, stall_s: float, started: float,
                 callback: SaveCallback | None = None, saver: "_Saver | None" = None) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.call_idx = call_idx
        self.step = step
        self.timings: SaveTimings | None = None
        self._queue = queue
        self._stall_s = stall_s
        self._started = started
        self._exception: BaseException | None = None
        self._committed = False
        self._callback = callback
        self._saver = saver
        self._staging: "_OverlappedStaging | None" = None

    def _set_committed(self, timings: SaveTimings) -> None:
        self.timings = timings
        self._committed = True

    def _check_failed(self) -> None:
        if self._exception is None and self._queue is not None and self.call_idx is not None:
            self._exception = self._queue.get_failure(self.call_idx)

    def synchronize_staging(self) -> None:
        """Wait until the state is staged, then start the write (overlapped saves).

        With ``overlap_staging=True`` the copy into host buffers runs while training
        goes on (the next forward/backward); call this before the state is mutated
        (before ``optimizer.step()``). Collective: every rank calls it (or a later
        ``save``/``wait``/``maybe_finalize``, which call it implicitly). The time
        spent here counts as stall. No-op for other saves.
        """
        if self._staging is not None and self._saver is not None:
            self._saver.synchronize_staging()

    def done(self) -> bool:
        """True once the save was committed or failed.

        Finalization happens in :meth:`wait`, ``CheckpointManager.maybe_finalize`` or
        ``AsyncCallsQueue.maybe_finalize_async_calls``. With a single process (no
        collective needed) this call also makes progress, without blocking.
        """
        if self._committed:
            return True
        self._check_failed()
        if self._exception is not None:
            return True
        queue = self._queue
        if (queue is not None and self.call_idx is not None and not queue.closed and not queue.sync.active
                and queue.is_pending(self.call_idx)):
            try:
                queue.maybe_finalize_async_calls(blocking=False)
            except CheckpointException:
                pass  # recorded by the queue; reported by exception()/wait()
            self._check_failed()
            if self._saver is not None:
                self._saver.fire_failure_callbacks()
        return self._committed or self._exception is not None

    def exception(self) -> BaseException | None:
        """The save's exception if it failed (``None`` if committed or pending)."""
        self._check_failed()
        return self._exception

    def wait(self, timeout: float | None = None) -> SaveTimings:
        """Block until the checkpoint is committed on all ranks (collective).

        Finalizes, in order, every earlier pending call of the queue too (and
        synchronizes an overlapped staging first).

        Args:
            timeout: seconds to wait for this rank's write (``None``: no limit). The
                collective commit that follows waits for the other ranks.

        Returns:
            The save's timings.

        Raises:
            CheckpointException: this save (or an earlier pending one) failed.
            CallbackError: a completion callback of this or an earlier save raised
                (the checkpoint itself is committed).
            TimeoutError: this rank's write did not finish within ``timeout``.
        """
        self.synchronize_staging()
        saver = self._saver
        try:
            if not self._committed:
                self._check_failed()
                if self._exception is not None:
                    raise self._exception
                queue = self._queue
                assert queue is not None and self.call_idx is not None
                if timeout is not None and not queue.wait_local(self.call_idx, timeout):
                    raise TimeoutError(f"the write of {self.checkpoint_dir} did not finish within {timeout} s")
                if queue.is_pending(self.call_idx):
                    queue.maybe_finalize_async_calls(blocking=True, until=self.call_idx)
                self._check_failed()
                if self._exception is not None:
                    raise self._exception
        except CheckpointException as exc:
            if saver is not None:
                saver.fire_failure_callbacks(exc)
            raise
        if saver is not None:
            saver.fire_failure_callbacks()
            saver.raise_callback_errors()
        if self.timings is None:
            raise CheckpointError(f"the save of {self.checkpoint_dir} was dropped before it was finalized")
        return self.timings

    def __repr__(self) -> str:
        state = "committed" if self._committed else ("failed" if self._exception else "pending")
        return f"SaveHandle({str(self.checkpoint_dir)!r}, {state})"


def _format_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n" + "".join(
        traceback.format_exception(type(exc), exc, exc.__traceback__))


class _OverlappedStaging:
    """A staging copy running in a thread while training goes on."""

    def __init__(self, handle: SaveHandle, request: AsyncRequest, slab: HostSlab,
                 on_scheduled: Callable[[SaveHandle], None] | None, run: Callable[[], None]) -> None:
        self.handle = handle
        self.request = request
        self.slab = slab
        self.on_scheduled = on_scheduled
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(run,), name="asyncckpt-staging", daemon=True)
        self.thread.start()

    def _run(self, run: Callable[[], None]) -> None:
        try:
            run()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the request's preload_fn
            self.error = exc


class _Saver:
    """Per-queue save state: staging buffers, copier, plan and layout caches, callbacks.

    Args:
        queue: the queue that runs the writes.
        staging_buffers: slabs that may exist at once (see :class:`Stager`).
        copy_threads: Python threads for staging copies (see :class:`StagingCopier`).
        write_threads: threads writing each data file (see ``WriteTask.threads``).
        plan_cache: reuse the save plan while the state's structure is unchanged.
    """

    def __init__(self, queue: AsyncCallsQueue, staging_buffers: int = 1, *, copy_threads: int = 1,
                 write_threads: int = 1, plan_cache: bool = True) -> None:
        if write_threads < 1:
            raise ValueError("write_threads must be >= 1")
        # A weak reference: the module's saver registry is keyed weakly by the queue,
        # and its buffers are freed when the queue goes (see _saver_for).
        self._queue_ref = weakref.ref(queue)
        self.stager = Stager(staging_buffers)
        self.copier = StagingCopier(copy_threads)
        self.write_threads = write_threads
        self.plan_cache: PlanCache | None = PlanCache() if plan_cache else None
        self._layouts: dict[Any, RankLayout] = {}
        self._lock = threading.RLock()
        self._overlapped: _OverlappedStaging | None = None
        self._awaiting: dict[int, SaveHandle] = {}  # call_idx -> handle with a callback not yet called
        self._callback_errors: list[tuple[SaveHandle, BaseException]] = []

    @property
    def queue(self) -> AsyncCallsQueue:
        queue = self._queue_ref()
        if queue is None:
            raise RuntimeError("the AsyncCallsQueue of this saver was garbage-collected")
        return queue

    def _layout(self, rank: int, plan: Any, blobs: dict[int, int]) -> RankLayout:
        # Keyed by the plan object (cached plans are reused as is) and the sizes of
        # the non-tensor values, which may change from save to save.
        key = (rank, id(plan), tuple(sorted(blobs.items())))
        hit = self._layouts.get(key)
        if hit is not None and hit[0] is plan:
            return hit[1]
        layout = build_layout(rank, list(plan.items), blobs)
        if len(self._layouts) >= 4:
            self._layouts.pop(next(iter(self._layouts)))
        self._layouts[key] = (plan, layout)
        return layout

    def _plan(self, state_dict: dict[str, Any], checkpoint_id: str, sync: SyncGroup, coordinator_rank: int,
              precheck: Callable[[], None] | None) -> tuple[Any, RankLayout]:
        """Plan collectively (or reuse the cached plan) and lay out this rank's files."""
        planned = plan_save(state_dict, checkpoint_id, sync, coordinator_rank, precheck, self.plan_cache)
        blobs = {i: len(d) for i, d in enumerate(planned.data) if isinstance(d, bytes)}
        return planned, self._layout(sync.rank, planned.plan, blobs)

    def _is_running(self, call_idx: int) -> bool:
        return self.queue.caller.is_running(call_idx)

    def _slab_for(self, layout: RankLayout, data: list[Any]) -> HostSlab:
        """A free slab formatted for ``layout`` (pinned if ``data`` has CUDA tensors)."""
        slab = self.stager.acquire(layout.slab_nbytes, layout.key, self._is_running,
                                   lambda idx: self.queue.wait_local(idx))
        if slab.layout_key != layout.key:
            # Format once per layout: the torch.save framing, and the tensor views the
            # copies go through (reused by every later save of this layout).
            for offset, framing in layout.static:
                slab.write_bytes(offset, framing)
            u8 = slab.u8
            slab.views = [(slot.item, u8[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape))
                          for slot in layout.tensors if slot.nbytes]
            slab.layout_key = layout.key
        if not slab.pinned and any(isinstance(d, torch.Tensor) and d.is_cuda for d in data):
            slab.pin()
        return slab

    def _copy(self, slab: HostSlab, layout: RankLayout, data: list[Any], synchronize: bool = True,
              cuda: bool = True) -> None:
        """Copy ``data`` into ``slab`` (tensors, then the non-tensor bytes)."""
        views = slab.views
        self.copier.copy([dst for _, dst in views], [data[item] for item, _ in views], cuda=cuda)
        for slot in layout.blobs:
            slab.write_bytes(slot.offset, data[slot.item])
        if synchronize:
            self.copier.synchronize()

    # ------------------------------------------------------------------ callbacks
    def _call_back(self, handle: SaveHandle, outcome: Any) -> None:
        callback, handle._callback = handle._callback, None  # called once
        if handle.call_idx is not None:
            self._awaiting.pop(handle.call_idx, None)
        if callback is None:
            return
        try:
            callback(outcome)
        except Exception as exc:  # reported by raise_callback_errors, never swallowed
            _log.error("the completion callback of the save of %s raised", handle.checkpoint_dir, exc_info=exc)
            self._callback_errors.append((handle, exc))

    def fire_failure_callbacks(self, exc: CheckpointException | None = None) -> None:
        """Call the callbacks of saves that failed (found by the queue)."""
        queue = self._queue_ref()
        for call_idx, handle in list(self._awaiting.items()):
            failure = (exc if exc is not None and exc.call_idx == call_idx
                       else queue.get_failure(call_idx) if queue is not None else None)
            if failure is not None:
                handle._exception = handle._exception or failure
                self._call_back(handle, failure)
        if exc is not None:
            self._attach_callback_errors(exc)

    def _attach_callback_errors(self, exc: BaseException) -> None:
        """Report the pending callback errors as notes of ``exc`` (which is raised instead)."""
        for handle, error in self._callback_errors:
            exc.add_note(f"the completion callback of the save of {handle.checkpoint_dir} also raised "
                         f"{type(error).__name__}: {error}")
        self._callback_errors.clear()

    def raise_callback_errors(self) -> None:
        """Raise :class:`CallbackError` for the callbacks that raised since the last call."""
        if not self._callback_errors:
            return
        errors, self._callback_errors = self._callback_errors, []
        lines = [f"{h.checkpoint_dir} (committed): {type(e).__name__}: {e}" for h, e in errors]
        raise CallbackError("a completion callback raised: " + "; ".join(lines), [e for _, e in errors]) \
            from errors[0][1]

    def prepare(self, state_dict: dict[str, Any], process_group: Any, coordinator_rank: int) -> int:
        """Plan ``state_dict`` and allocate and format its staging buffer, writing nothing.

        Returns:
            The bytes of host memory the staging buffer holds.
        """
        with self._lock:
            self.synchronize_staging()
            sync = SyncGroup(process_group)
            planned, layout = self._plan(state_dict, "", sync, coordinator_rank, None)
            return self._slab_for(layout, planned.data).nbytes

    # ------------------------------------------------------------------ overlap
    def synchronize_staging(self) -> None:
        """Finish an overlapped staging and schedule its write (collective)."""
        with self._lock:
            pending, self._overlapped = self._overlapped, None
            if pending is None:
                return
            started = time.monotonic()
            call_idx = self.queue.schedule_async_request(pending.request)  # preload joins the copy
            self.stager.lease(pending.slab, call_idx)
            handle = pending.handle
            handle.call_idx = call_idx
            handle._staging = None
            handle._stall_s += time.monotonic() - started
            if handle._callback is not None:
                self._awaiting[call_idx] = handle
            if pending.on_scheduled is not None:
                pending.on_scheduled(handle)

    def save(
        self,
        state_dict: dict[str, Any],
        checkpoint_dir: str | os.PathLike,
        *,
        async_op: bool,
        process_group: Any,
        coordinator_rank: int,
        step: int | None = None,
        overlap_staging: bool = False,
        callback: SaveCallback | None = None,
        on_commit: Callable[[Path], None] | None = None,
        on_committed: Callable[[SaveHandle], None] | None = None,
        on_scheduled: Callable[[SaveHandle], None] | None = None,
    ) -> SaveHandle:
        started = time.monotonic()
        self.synchronize_staging()  # an earlier overlapped save is scheduled first
        final_dir = Path(checkpoint_dir).absolute()
        sync = SyncGroup(process_group)
        if not 0 <= coordinator_rank < sync.world_size:
            raise ValueError(f"coordinator_rank {coordinator_rank} is not a rank of the group")

        def precheck() -> None:
            if final_dir.exists() and (not final_dir.is_dir() or any(final_dir.iterdir())):
                raise FileExistsError(f"{final_dir} exists and is not an empty directory; "
                                      "a checkpoint never overwrites one")

        planned, layout = self._plan(state_dict, str(final_dir), sync, coordinator_rank, precheck)
        tmp_dir = _commit.temporary_dir_for(final_dir, planned.token)
        data = planned.data
        metadata = planned.metadata
        handle = SaveHandle(final_dir, None, None, step, 0.0, started, callback, self)
        slab_box: list[HostSlab] = []
        overlapped: list[_OverlappedStaging] = []

        def task_for(slab: HostSlab) -> WriteTask:
            return WriteTask(str(tmp_dir), slab.ref, layout.files, self.stager.live_slab_ids,
                             umask=current_umask(), threads=self.write_threads)

        def preload() -> WriteTask:
            if overlapped:  # the copy ran in a thread: wait for it
                pending = overlapped.pop()
                pending.thread.join()
                data.clear()
                self.copier.synchronize()
                if pending.error is not None:
                    raise pending.error
                return task_for(pending.slab)
            slab = self._slab_for(layout, data)
            self._copy(slab, layout, data)
            data.clear()  # drop references to the user's tensors
            slab_box.append(slab)
            return task_for(slab)

        def finalize() -> None:
            result: RankWriteResult = (self.queue.get_result(handle.call_idx) if async_op else sync_result[0])
            commit_started = time.monotonic()
            gathered = sync.all_gather_object((layout.storage_data, result))
            status: str | None = None
            if sync.rank == coordinator_rank:
                try:
                    storage_data: dict = {}
                    for sd, _ in gathered:
                        storage_data.update(sd)
                    metadata.storage_data = storage_data
                    metadata.version = CURRENT_DCP_VERSION
                    files = [f for _, r in gathered for f in r.files]
                    info = {"world_size": sync.world_size, "step": step}
                    _commit.commit_directory(tmp_dir, final_dir, pickle.dumps(metadata), files, info)
                    if on_commit is not None:
                        on_commit(final_dir)
                except Exception as exc:
                    status = _format_exc(exc)
            status = sync.broadcast_object(status, coordinator_rank)
            if status is not None:
                exc = CheckpointException(handle.call_idx if handle.call_idx is not None else -1,
                                          {coordinator_rank: "commit failed: " + status})
                handle._exception = exc
                raise exc
            now = time.monotonic()
            write_s = max(r.write_s for _, r in gathered)
            nbytes = sum(r.nbytes for _, r in gathered)
            timings = SaveTimings(
                stall_s=handle._stall_s, write_s=write_s, finalize_s=now - commit_started,
                total_s=now - handle._started, bytes=nbytes, gbps=nbytes / write_s / 1e9 if write_s > 0 else 0.0)
            handle._set_committed(timings)
            if on_committed is not None:
                on_committed(handle)
            self._call_back(handle, SaveResult(final_dir, step, timings, nbytes))

        if not async_op:
            # Synchronous: the same steps in this thread, no background process.
            task = preload()
            sync_result: list[RankWriteResult] = []
            error = None
            try:
                sync_result.append(write_rank_files(task))
            except Exception as exc:
                error = _format_exc(exc)
            errors = {r: e for r, e in enumerate(sync.all_gather_object(error)) if e is not None}
            try:
                if errors:
                    raise CheckpointException(-1, errors)
                handle._stall_s = time.monotonic() - started
                finalize()
            except CheckpointException as exc:
                handle._exception = exc
                self._call_back(handle, exc)
                self._attach_callback_errors(exc)
                raise
            self.raise_callback_errors()
            return handle

        handle._queue = self.queue
        request = AsyncRequest(write_rank_files, (), [finalize], preload_fn=preload)
        if overlap_staging:
            slab = self._slab_for(layout, data)
            # D2H copies are issued here (ordered after this thread's current stream,
            # they run asynchronously); the CPU copies run in a thread.
            views = slab.views
            self.copier.copy([dst for _, dst in views], [data[item] for item, _ in views], cpu=False)
            pending = _OverlappedStaging(handle, request, slab, on_scheduled,
                                         lambda: self._copy(slab, layout, data, synchronize=False, cuda=False))
            overlapped.append(pending)
            handle._staging = pending
            handle._stall_s = time.monotonic() - started
            self._overlapped = pending
            return handle
        call_idx = self.queue.schedule_async_request(request)
        if slab_box:
            self.stager.lease(slab_box[0], call_idx)
        handle.call_idx = call_idx
        handle._stall_s = time.monotonic() - started
        if callback is not None:
            self._awaiting[call_idx] = handle
        if on_scheduled is not None:
            on_scheduled(handle)
        return handle

    def release(self) -> None:
        """Free the staging buffers (only when no write of this saver runs)."""
        pending, self._overlapped = self._overlapped, None
        if pending is not None:
            pending.thread.join()
        self.copier.close()
        self.stager.release_all()
        self._layouts.clear()


# ------------------------------------------------------------------ free functions
_savers: "weakref.WeakKeyDictionary[AsyncCallsQueue, _Saver]" = weakref.WeakKeyDictionary()
_default_queues: dict[int, tuple[Any, AsyncCallsQueue]] = {}
_module_lock = threading.Lock()


def _saver_for(queue: AsyncCallsQueue, staging_buffers: int = 1) -> _Saver:
    with _module_lock:
        saver = _savers.get(queue)
        if saver is None:
            saver = _Saver(queue, staging_buffers)
            _savers[queue] = saver
            weakref.finalize(queue, saver.release)  # free the staging buffers with the queue
        return saver


def _default_queue(process_group: Any) -> AsyncCallsQueue:
    with _module_lock:
        hit = _default_queues.get(id(process_group))
        if hit is not None and hit[0] is process_group and not hit[1].closed:
            return hit[1]
        queue = AsyncCallsQueue(persistent=True, process_group=process_group, import_main=False)
        _default_queues[id(process_group)] = (process_group, queue)
        return queue


def save(
    state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike,
    *,
    async_op: bool = False,
    calls_queue: AsyncCallsQueue | None = None,
    process_group: Any = None,
    coordinator_rank: int = 0,
    overlap_staging: bool = False,
    callback: SaveCallback | None = None,
) -> SaveHandle:
    """Save ``state_dict`` as a torch.distributed.checkpoint directory, atomically.

    Collective: every rank of ``process_group`` calls it with its own state_dict.

    Args:
        state_dict: nested dicts / lists of tensors (CPU or CUDA, any dtype, DTensor
            included: each rank stages and writes only its local shards) and
            picklable Python values.
        checkpoint_dir: the directory to create; must not exist (or be empty).
        async_op: ``False``: write and commit before returning. ``True``: stage (copy
            into reused host buffers) and return; the write runs in the background and
            the commit happens when the handle is waited for or the queue finalized.
            Mutating the state after return never changes the checkpoint.
        calls_queue: the queue that runs the write (default: a persistent worker
            shared by all ``save`` calls of this process group).
        process_group: the ranks saving together (default: the default group, or a
            single process without ``torch.distributed``).
        coordinator_rank: the rank (in ``process_group``) that commits.
        overlap_staging: (``async_op=True``) return right after planning and copy in
            a background thread, overlapping the next forward/backward; the state
            must not be mutated until ``handle.synchronize_staging()`` (call it before
            ``optimizer.step()``), as with DCP's ``AsyncStager.synchronize_staging``.
        callback: called once, in this process, after finalize, with the
            :class:`SaveResult` (committed) or the exception (failed). If it raises,
            the error is logged and raised as :class:`CallbackError` by the next
            ``wait`` (the queue and the checkpoint are unaffected).

    Returns:
        A :class:`SaveHandle`; for ``async_op=False`` it is already committed.

    Raises:
        CheckpointError: invalid input or target on any rank (raised on every rank,
            before anything is written).
        CheckpointException: (``async_op=False``) the write or commit failed on some
            rank; nothing was committed.
        ValueError: ``overlap_staging`` without ``async_op``.
    """
    if overlap_staging and not async_op:
        raise ValueError("overlap_staging needs async_op=True")
    queue = calls_queue if calls_queue is not None else _default_queue(process_group)
    saver = _saver_for(queue)
    with saver._lock:
        return saver.save(state_dict, checkpoint_dir, async_op=async_op, process_group=process_group,
                          coordinator_rank=coordinator_rank, overlap_staging=overlap_staging, callback=callback)


def verify(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """Check a committed checkpoint against its manifest (sizes and CRC-32s).

    Returns:
        The manifest (``files``, ``total_bytes``, ``world_size``, ``step``, ...).

    Raises:
        CorruptCheckpointError: naming the first missing or mismatching file.
    """
    return _commit.verify_checkpoint(checkpoint_dir)


def load(
    state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike,
    *,
    process_group: Any = None,
    verify: bool = True,
    allow_pickle: bool = False,
) -> None:
    """Load a checkpoint into ``state_dict`` in place, like ``torch.distributed.checkpoint.load``.

    Tensors are copied into the given tensors (any device; resharded as DCP does);
    other values are replaced in the given dicts. Collective over ``process_group``.

    The checkpoint is not trusted (:mod:`asyncckpt.storage.reader`): ``.metadata`` is
    unpickled with an allowlist of DCP metadata classes; every file it or the manifest
    names must be a plain file name of a regular file (not a symlink) inside
    ``checkpoint_dir``; non-tensor values load with ``torch.load(weights_only=True)``
    semantics, all decoded before any tensor of ``state_dict`` is written.

    Args:
        state_dict: the structure to fill; its keys select what is read.
        checkpoint_dir: a committed checkpoint directory.
        process_group: the ranks loading together.
        verify: check sizes and CRC-32 checksums of the files first (each rank checks
            a share of the files; any mismatch fails every rank). The path checks
            above run either way.
        allow_pickle: unpickle non-tensor values of any class (stock DCP's
            ``weights_only=False``). Unpickling runs code chosen by whoever wrote the
            checkpoint: pass ``True`` only for checkpoints you trust. To allow a few
            classes instead, use ``torch.serialization.safe_globals([...])``.

    Raises:
        CorruptCheckpointError: ``checkpoint_dir`` is not a committed checkpoint; a
            file is missing or corrupt (with ``verify``); the metadata holds a
            disallowed global; the metadata or the manifest names a path outside the
            directory or a symlink.
        CheckpointError: a non-tensor value needs ``allow_pickle=True`` (its entry is
            named; ``state_dict`` is left unchanged).
    """
    path = Path(checkpoint_dir)
    sync = SyncGroup(process_group)
    reader = SafeFileSystemReader(str(path))
    error: tuple[str, str | None] | None = None
    try:
        manifest = _commit.read_manifest(path)  # also refuses names outside the directory
        if verify:
            names = sorted(manifest["files"])[sync.rank::sync.world_size]
            _commit.verify_checkpoint(path, names)
        reader.check_manifest(manifest["files"])  # reads and checks .metadata
    except CorruptCheckpointError as exc:
        error = (str(exc), exc.path)
    errors = [e for e in sync.all_gather_object(error) if e is not None]
    if errors:
        raise CorruptCheckpointError(errors[0][0], errors[0][1] or str(path))
    planner = SafeLoadPlanner(allow_pickle=allow_pickle)
    try:
        with warnings.catch_warnings():
            # Without a process group DCP warns that it loads in a single process: intended.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group)
    except _DcpCheckpointException as exc:
        # DCP wraps every rank's failure; ours (CheckpointError) are re-raised as such,
        # the same one (the lowest rank's) on every rank.
        for _, (cause, _tb) in sorted(exc.failures.items()):
            if isinstance(cause, CorruptCheckpointError):
                raise CorruptCheckpointError(str(cause), cause.path) from exc
            if isinstance(cause, CheckpointError):
                raise CheckpointError(str(cause)) from exc
        raise


# ------------------------------------------------------------------ manager
_STEP_RE = _commit.STEP_DIR_RE
_LEFTOVER_RE = _commit.LEFTOVER_RE


class CheckpointManager:
    """Numbered asynchronous checkpoints in one root directory, with retention.

    Layout: ``root_dir/step_00000100/`` (one committed checkpoint per step), and
    ``root_dir/latest`` naming the newest committed one. Like Orbax's
    CheckpointManager, policy (``keep_last``) is data.

    Args:
        root_dir: the root directory (created if missing).
        keep_last: keep this many newest checkpoints (``None``: keep all). Older ones
            are removed only after a newer one committed.
        persistent: one long-lived worker (default) or a forked child per save.
        process_group: the ranks saving together.
        coordinator_rank: the rank that commits.
        staging_buffers: host buffers (each one copy of this rank's state); 2 lets a
            save stage while the previous one still writes.
        start_method: ``"spawn"`` or ``"forkserver"`` for the persistent worker.
        calls_queue: use this queue instead of creating one (then ``close`` does not
            close it).
        overlap_staging: ``save`` returns right after planning and the copy runs in
            a background thread while training goes on; call
            :meth:`synchronize_staging` before the state is mutated (before
            ``optimizer.step()``). Default ``False``: ``save`` returns once staged.
        copy_threads: Python threads for the staging copy of CPU tensors (default 1:
            torch's intra-op threads already split each copy).
        write_threads: threads writing each data file with positioned writes
            (default 1: one sequential stream).
        plan_cache: reuse the save plan and metadata while the state's structure
            is unchanged (default ``True``).
        callback: the default completion callback of :meth:`save` (see there).

    Collective: ``save``, ``maybe_finalize``, ``load`` and ``close`` are called by
    every rank in the same order.
    """

    def __init__(
        self,
        root_dir: str | os.PathLike,
        *,
        keep_last: int | None = None,
        persistent: bool = True,
        process_group: Any = None,
        coordinator_rank: int = 0,
        staging_buffers: int = 1,
        start_method: str = "spawn",
        calls_queue: AsyncCallsQueue | None = None,
        overlap_staging: bool = False,
        copy_threads: int = 1,
        write_threads: int = 1,
        plan_cache: bool = True,
        callback: SaveCallback | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 or None")
        self.root_dir = Path(root_dir).absolute()
        self.root_dir.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last
        self.process_group = process_group
        self.coordinator_rank = coordinator_rank
        self._owns_queue = calls_queue is None
        self.queue = calls_queue or AsyncCallsQueue(persistent, process_group=process_group,
                                                    start_method=start_method, import_main=False)
        if self._owns_queue and isinstance(self.queue.caller, PersistentAsyncCaller):
            self.queue.caller.start()  # ready before the first save: no start-up stall
        self.overlap_staging = overlap_staging
        self.callback = callback
        self._saver = _Saver(self.queue, staging_buffers, copy_threads=copy_threads,
                             write_threads=write_threads, plan_cache=plan_cache)
        self._handles: dict[int, SaveHandle] = {}
        self._recent_commits: collections.OrderedDict[int, int] = collections.OrderedDict()  # call_idx -> step
        self._closed = False
        self._deletion: threading.Thread | None = None  # the retention removal in flight
        #: Timings of the most recently committed save (``None`` before the first).
        self.last_committed_timings: SaveTimings | None = None

    def step_dir(self, step: int) -> Path:
        """The directory of step ``step``."""
        return self.root_dir / _commit.step_dir_name(step)

    def _on_commit(self, final_dir: Path) -> None:
        # Coordinator only, inside finalize, after the rename: latest, then retention,
        # then leftovers of saves that can no longer commit.
        _commit.write_latest(self.root_dir, final_dir.name)
        if self.keep_last is not None:
            for old in self.steps()[:-self.keep_last]:
                path = self.step_dir(old)
                if path != final_dir:
                    self._join_deletion()  # at most one removal in flight: bounded disk use
                    try:
                        self._deletion = _commit.remove_checkpoint(path, background=True)
                    except OSError:
                        pass  # retention is best effort; never fails a committed save
        m = _STEP_RE.match(final_dir.name)
        if m:
            self._remove_leftovers(int(m.group(1)))

    def _remove_leftovers(self, committed_step: int) -> None:
        """Remove hidden temporary directories of steps up to ``committed_step`` (saves
        that failed or were killed: finalize runs in ``call_idx`` order, so none of them
        can still commit) and half-deleted old checkpoints."""
        pending = {h.step for h in self._handles.values()}
        deletion = self._deletion
        being_deleted = deletion.name.partition(":")[2] if deletion is not None and deletion.is_alive() else None
        for entry in os.scandir(self.root_dir):
            m = _LEFTOVER_RE.match(entry.name)
            if (m and int(m.group(1)) <= committed_step and int(m.group(1)) not in pending
                    and entry.name != being_deleted and entry.is_dir(follow_symlinks=False)):
                shutil.rmtree(entry.path, ignore_errors=True)

    def save(self, step: int, state_dict: dict[str, Any], *, async_op: bool = True,
             callback: SaveCallback | None = None) -> SaveHandle:
        """Save ``state_dict`` as step ``step`` (see :func:`asyncckpt.save`).

        Args:
            step: the step number (names the directory ``step_%08d``).
            state_dict: the state (see :func:`asyncckpt.save`).
            async_op: stage and return (default), or write and commit first.
            callback: called once, in this process, after finalize, with the
                :class:`SaveResult` (committed) or the exception (failed); default
                the manager's ``callback``. If it raises, the error is logged and
                raised as :class:`CallbackError` by the next :meth:`maybe_finalize`,
                ``handle.wait`` or :meth:`close`; the queue goes on.

        Returns:
            The handle; committed steps are also reported by :meth:`maybe_finalize`.

        Raises:
            CheckpointError: invalid input, or step ``step`` already exists.
        """
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        with self._saver._lock:
            return self._saver.save(
                state_dict, self.step_dir(step), async_op=async_op, process_group=self.process_group,
                coordinator_rank=self.coordinator_rank, step=int(step),
                overlap_staging=self.overlap_staging and async_op,
                callback=callback if callback is not None else self.callback,
                on_commit=self._on_commit, on_committed=self._on_committed, on_scheduled=self._on_scheduled)

    def prepare(self, state_dict: dict[str, Any]) -> int:
        """Get ready for saves of ``state_dict``'s structure before the first one (collective).

        Plans the save (the plan is cached), then allocates, page-faults and formats
        the staging buffer, so that the first ``save`` stalls no longer than later
        ones: allocating fresh host memory costs several times a copy into memory
        already mapped. Nothing is written. Optional; call it e.g. after building the
        model and optimizer state.

        Args:
            state_dict: a state of the structure (keys, dtypes, shapes) to be saved.

        Returns:
            The bytes of host memory the staging buffer holds (this rank).

        Raises:
            CheckpointError: invalid input on any rank (raised on every rank).
        """
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        return self._saver.prepare(state_dict, self.process_group, self.coordinator_rank)

    def synchronize_staging(self) -> None:
        """Wait until an overlapped save is staged and start its write (collective).

        With ``overlap_staging=True``, call it after the next forward/backward and
        before ``optimizer.step()``: the state must not change while it is copied.
        The wait counts as the save's stall. No-op when nothing is being staged.
        """
        self._saver.synchronize_staging()

    def _on_scheduled(self, handle: SaveHandle) -> None:
        assert handle.call_idx is not None
        self._handles[handle.call_idx] = handle

    def _on_committed(self, handle: SaveHandle) -> None:
        # Every rank, in finalize, whoever drove it (maybe_finalize, handle.wait, close).
        self.last_committed_timings = handle.timings
        if handle.call_idx is not None:
            self._handles.pop(handle.call_idx, None)
            self._recent_commits[handle.call_idx] = handle.step
            while len(self._recent_commits) > 64:
                self._recent_commits.popitem(last=False)

    def maybe_finalize(self, blocking: bool = False) -> list[int]:
        """Commit the saves that finished on every rank (collective).

        Args:
            blocking: wait for every pending save.

        Returns:
            The steps committed by this call, in order.

        Raises:
            CheckpointException: a save failed on some rank (same on every rank);
                nothing of it was committed, ``latest`` is unchanged.
            CallbackError: a completion callback raised (its save is committed).
        """
        self._saver.synchronize_staging()
        try:
            call_idxs = self.queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointException as exc:
            failed = self._handles.pop(exc.call_idx, None)
            if failed is not None:
                failed._exception = exc
            self._saver.fire_failure_callbacks(exc)
            raise
        self._saver.fire_failure_callbacks()
        steps = [self._recent_commits.pop(idx) for idx in call_idxs if idx in self._recent_commits]
        self._saver.raise_callback_errors()
        return steps

    def steps(self) -> list[int]:
        """Committed steps, ascending (partial or temporary directories are ignored)."""
        found = []
        for entry in os.scandir(self.root_dir):
            m = _STEP_RE.match(entry.name)
            if m and entry.is_dir(follow_symlinks=False) and _commit.is_committed(Path(entry.path)):
                found.append(int(m.group(1)))
        return sorted(found)

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None``.

        A renamed step directory is complete (the rename is the commit), and ``latest``
        is replaced only after it, so ``latest`` can lag behind the newest committed
        step (a crash between the two) but never lead it: the newest committed step
        is what to resume from. ``latest`` is for readers outside asyncckpt.
        """
        steps = self.steps()
        return steps[-1] if steps else None

    def load(self, state_dict: dict[str, Any], step: int | None = None, *, verify: bool = True,
             allow_pickle: bool = False) -> int:
        """Load step ``step`` (default: the latest) into ``state_dict`` in place.

        ``verify`` and ``allow_pickle`` are those of :func:`asyncckpt.load`.

        Returns:
            The step loaded.

        Raises:
            FileNotFoundError: there is no committed checkpoint (or not that step).
            CorruptCheckpointError: the checkpoint does not match its manifest, or
                names a path outside its directory.
            CheckpointError: a non-tensor value needs ``allow_pickle=True``.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no committed checkpoint in {self.root_dir}")
        path = self.step_dir(step)
        if not _commit.is_committed(path):
            raise FileNotFoundError(f"step {step} has no committed checkpoint in {self.root_dir}")
        load(state_dict, path, process_group=self.process_group, verify=verify, allow_pickle=allow_pickle)
        return int(step)

    def close(self, abort: bool = False) -> None:
        """Commit pending saves and stop the worker; ``abort`` drops them instead.

        Idempotent. With ``abort=True``: no collective, the worker is terminated,
        pending saves stay uncommitted (their temporary directories are hidden).

        Raises:
            CheckpointException: (``abort=False``) a pending save failed.
            CallbackError: (``abort=False``) a completion callback raised.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if not abort:
                self._saver.synchronize_staging()
            try:
                if self._owns_queue:
                    self.queue.close(abort=abort)
                elif not abort:
                    self.maybe_finalize(blocking=True)
            except CheckpointException as exc:
                self._saver.fire_failure_callbacks(exc)
                raise
            self._saver.fire_failure_callbacks()  # saves dropped by an abort
            if not abort:
                self._saver.raise_callback_errors()
        finally:
            if self._owns_queue or abort:
                self._saver.release()
            self._handles.clear()
            self._join_deletion()

    def _join_deletion(self) -> None:
        if self._deletion is not None:
            self._deletion.join()
            self._deletion = None

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(abort=exc_type is not None)
