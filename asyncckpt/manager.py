"""CheckpointManager: numbered asynchronous checkpoints in one root, with retention.

Small on purpose, like Orbax's ``CheckpointManager``: the phases live in
:mod:`asyncckpt.saving.saver`, the root's naming, ``latest`` and retention in
:mod:`asyncckpt.root`, the options in :class:`asyncckpt.SaveOptions`.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from asyncckpt._check import check_callback, check_path, check_state_dict, check_step, check_step_info
from asyncckpt._exit import EXIT_TIMEOUT_ENV, exit_timeout
from asyncckpt._gc import gc_paused
from asyncckpt.async_utils.callers import PersistentAsyncCaller
from asyncckpt.async_utils.calls_queue import AsyncCallsQueue
from asyncckpt.dist import SyncGroup
from asyncckpt.errors import (
    AsyncckptError,
    CheckpointError,
    CheckpointException,
    CheckpointNotFoundError,
    InvalidArgumentError,
    InvalidStateError,
    PreemptionBudgetExpired,
    RankFailure,
)
from asyncckpt.format import manifest as _manifest
from asyncckpt.io.local_tier import LocalTier
from asyncckpt.loading.api import LoadTimings, load, read_metadata
from asyncckpt.options import SaveOptions
from asyncckpt.policy import PreservationPolicy, SaveInterval, as_policy
from asyncckpt.replication import LocalCheckpoints, RestoreResult
from asyncckpt.root import CheckpointRoot
from asyncckpt.saving.handle import SaveCallback, SaveHandle, SaveTimings
from asyncckpt.saving.pending import release_when_settled
from asyncckpt.saving.saver import Saver
from asyncckpt.upload import Uploader

__all__ = ["CheckpointManager"]

_log = logging.getLogger("asyncckpt")


class CheckpointManager:
    """Numbered asynchronous checkpoints in one root directory, with retention.

    Layout: ``root_dir/step_00000100/`` (one committed checkpoint per step), and
    ``root_dir/latest`` naming the newest committed one. Like Orbax's
    CheckpointManager, policy (``keep_last`` / ``keep``, ``save_interval``,
    :class:`SaveOptions`) is data.

    Args:
        root_dir: the root directory (created if missing).
        keep_last: keep this many newest checkpoints (``None``: keep all). Older ones
            are removed only after a newer one committed. The short form of
            ``keep=LatestN(keep_last)``.
        keep: a preservation policy (:mod:`asyncckpt.policy`: ``LatestN``,
            ``EveryNSteps``, ``EveryNSeconds``, ``BestN`` by the ``metrics`` of
            :meth:`save`, ``AnyOf``); with ``keep_last`` too, a step is kept if either
            keeps it. Retention never removes the newest save, runs on the coordinator
            after each commit, and takes no collective.
        save_interval: which steps :meth:`should_save` says to save
            (:class:`asyncckpt.policy.SaveInterval`: every ``steps`` and/or
            ``seconds``).
        persistent: one long-lived worker (default) or a forked child per save.
        process_group: the ranks saving together.
        coordinator_rank: the rank that commits.
        start_method: ``"spawn"`` (default) or ``"forkserver"`` for the persistent
            worker (not with ``persistent=False``).
        calls_queue: use this queue instead of creating one (then ``close`` does not
            close it); not together with ``persistent`` or ``start_method``.
        options: staging and writing options (:class:`SaveOptions`); or give them one
            by one: ``staging_buffers``, ``copy_threads``, ``write_threads``,
            ``plan_cache``, ``overlap_staging`` (not both).
        callback: the default completion callback of :meth:`save` (see there); a
            callable or ``None``.
        read_only: only read the root (``steps``, ``latest_step``, ``load``; e.g. an
            evaluation job following a training job's root): nothing is created, no
            lock is taken, and :meth:`save` and :meth:`prepare` raise
            ``CheckpointError``; not together with ``keep_last``, ``keep``,
            ``keep_remote``, ``callback`` or save options.
        upload_to: ``s3://bucket/prefix``: upload every committed step there, in the
            background (:mod:`asyncckpt.upload`; the ``s3`` extra; configured by the
            standard AWS variables, ``AWS_ENDPOINT_URL`` for S3-compatible stores).
            ``latest_step`` and ``load`` then restore from the newest step over both
            tiers; committed local steps not yet uploaded are uploaded at start.
        keep_remote: keep this many newest uploaded steps remotely (``None``: all).
        upload_failure: ``"warn"`` (default: an ``UploadWarning`` from
            :meth:`maybe_finalize` / :meth:`close`) or ``"raise"`` (``UploadError``).
            Either way the outcome of each step's upload (``UploadResult`` or
            ``UploadError``) also goes to the completion callback, and training is
            never blocked. Uploads slower than the saves: once
            ``MAX_WAITING_UPLOADS`` (3) steps wait for their upload on some rank, the
            waiting ones are dropped on every rank for the newest (``UploadSkipped``
            to the callback, a warning logged once), so the backlog and the files it
            holds stay bounded.
        upload_timeout_s: seconds :meth:`close` waits for the uploads in flight (then
            they are resumed at the next start; stopping the upload process takes at
            most about 1.5 s more), and the coordinator for the other ranks' objects of
            a step.
        upload_process: upload the bytes from a process of its own (default; see
            :mod:`asyncckpt.io.s3_agent`: the requests' Python work then never takes
            the training process's GIL); ``False``: from a thread of this process
            (no extra process).
        local: a node-local tier beside the root (:class:`~asyncckpt.LocalTier`: a
            directory on each node, saved every ``every`` steps with
            ``manager.local.save(step, state)``, replicated to ``replicas`` peer
            nodes; :meth:`restore` restores the newest of both tiers). ``None``: none.

    The manager holds an exclusive lock on ``root_dir`` for its lifetime (taken by
    the ``coordinator_rank``, the one rank that writes ``latest`` and runs retention;
    the other ranks of the same job share the root), released by :meth:`close`, when
    the manager is collected, or when its process ends (also killed): two jobs never
    save into one root. Reading needs no lock (:func:`asyncckpt.load`,
    :func:`asyncckpt.read_state_dict`, the ``asyncckpt`` command).

    Every argument is checked before the root is locked, and a constructor that
    raises leaves the root unlocked (a corrected retry in the ``except`` block, or in
    a notebook, gets the root).

    Raises:
        InvalidArgumentError: (a ``ValueError`` and ``TypeError``) a bad argument
            (``root_dir`` not a path, ``keep_last`` not an int >= 1,
            ``coordinator_rank`` not an int, ``callback`` not callable); contradictory arguments (one that the
            others make ignored: ``start_method`` with ``persistent=False``,
            ``calls_queue`` with ``persistent`` or ``start_method``, ``read_only``
            with ``keep_last``, ``callback`` or save options), naming both; a bad option.
        RootInUseError: another manager (this process or another, named by pid and
            host) holds ``root_dir``'s lock (on every rank).
        RemoteStorageError: ``upload_to`` without boto3 (the ``s3`` extra) installed.
        CheckpointPathError: ``root_dir`` cannot be created, is not a directory, or
            cannot be written (with the builtin type and ``errno`` of the cause:
            ``EROFS`` for a read-only mount, a ``PermissionError`` with ``EACCES`` for
            a root without write permission), or its lock file is not a regular file
            (on every rank).
        CheckpointNotFoundError: (a ``FileNotFoundError``; ``read_only=True``) there
            is no ``root_dir``: a reader creates nothing.

    Collective contract (every rank, in the same order): the constructor,
    :meth:`save`, :meth:`prepare`, :meth:`load`, :meth:`close`, and
    :meth:`synchronize_staging` with overlapped staging. :meth:`maybe_finalize` is
    not collective (the commit runs in the queue's finalizer thread): ranks may call
    it different numbers of times. With a ``calls_queue`` that is not
    ``background_finalize``, ``maybe_finalize`` drives it and is collective again.
    """

    def __init__(
        self,
        root_dir: str | os.PathLike,
        *,
        keep_last: int | None = None,
        persistent: bool | None = None,
        process_group: Any = None,
        coordinator_rank: int = 0,
        staging_buffers: int | None = None,
        start_method: str | None = None,
        calls_queue: AsyncCallsQueue | None = None,
        overlap_staging: bool | None = None,
        copy_threads: int | None = None,
        write_threads: int | None = None,
        plan_cache: bool | None = None,
        callback: SaveCallback | None = None,
        options: SaveOptions | None = None,
        read_only: bool = False,
        keep: PreservationPolicy | None = None,
        save_interval: SaveInterval | None = None,
        upload_to: str | None = None,
        keep_remote: int | None = None,
        upload_failure: Literal["warn", "raise"] = "warn",
        upload_timeout_s: float = 600.0,
        upload_process: bool = True,
        local: LocalTier | None = None,
    ) -> None:
        self._closed = True  # until constructed
        #: The node-local tier (``None`` without ``local=``): ``local.save(step, state)``,
        #: ``local.maybe_finalize()``; see :class:`asyncckpt.replication.LocalCheckpoints`.
        self.local: LocalCheckpoints | None = None
        if local is not None and (not isinstance(local, LocalTier) or read_only):
            raise InvalidArgumentError(f"local must be a LocalTier (and not read_only), not {local!r}")
        # Every argument is checked before the root is locked (item 6 of issue 30): a
        # constructor that raises leaves no lock behind, whatever holds its traceback.
        check_path(root_dir, what="root_dir")
        if calls_queue is not None and (persistent is not None or start_method is not None):
            raise InvalidArgumentError(
                "calls_queue= cannot be combined with persistent= or start_method=: "
                "the queue already decides how calls run"
            )
        if read_only:
            ignored = [
                name
                for name, value in (
                    ("keep_last", keep_last),
                    ("keep", keep),
                    ("options", options),
                    ("staging_buffers", staging_buffers),
                    ("copy_threads", copy_threads),
                    ("write_threads", write_threads),
                    ("plan_cache", plan_cache),
                    ("overlap_staging", overlap_staging),
                    ("callback", callback),
                    ("keep_remote", keep_remote),
                )
                if value is not None
            ]
            if ignored:
                raise InvalidArgumentError(
                    f"read_only=True cannot be combined with {'=, '.join(ignored)}=: a read-only "
                    "manager never saves nor removes checkpoints"
                )
        if upload_to is not None:  # before the root's lock and the worker: nothing to undo
            Uploader.check_options(upload_to, keep_remote, upload_failure, upload_timeout_s)
        elif keep_remote is not None:
            raise InvalidArgumentError("keep_remote= needs upload_to=: there is no remote tier to keep steps in")
        if start_method is not None and persistent is False:
            raise InvalidArgumentError(
                f"start_method={start_method!r} cannot be combined with persistent=False: the "
                "persistent=False caller forks a child per save, with no worker to start"
            )
        self.options = SaveOptions.resolve(
            options,
            staging_buffers=staging_buffers,
            copy_threads=copy_threads,
            write_threads=write_threads,
            plan_cache=plan_cache,
            overlap_staging=overlap_staging,
        )
        if isinstance(coordinator_rank, bool) or not isinstance(coordinator_rank, int):
            raise InvalidArgumentError(f"coordinator_rank must be an int, not {coordinator_rank!r}")
        check_callback(callback)
        if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
            raise InvalidArgumentError(f"keep_last must be an int >= 1 or None, not {keep_last!r}")
        as_policy(keep_last, keep)  # checked before the root is locked
        if save_interval is not None and not isinstance(save_interval, SaveInterval):
            raise InvalidArgumentError(f"save_interval must be a SaveInterval, not {save_interval!r}")
        #: Which steps :meth:`should_save` saves (``None``: it says True only on preemption).
        self.save_interval = save_interval
        #: The ``PreemptionSave`` watching this manager (its constructor sets it).
        self.preemption: Any = None
        self._clock: tuple[int, float] | None = None  # (step, time.monotonic()) of this rank's last save
        self._timed_due: int | None = None  # the agreed step of the next time-based save
        self.read_only = bool(read_only)
        self._owns_queue = calls_queue is None
        persistent = True if persistent is None else persistent
        worker: dict[str, Any] = {}
        if persistent:  # a spawned worker without the training script (forkserver's server has it already)
            worker = {
                "start_method": start_method or "spawn",
                "import_main": False if start_method in (None, "spawn") else None,
            }
        # Built (and so checked: start_method="fork" is refused here) before the root is
        # locked; it starts nothing and issues no collective until started.
        self.queue = calls_queue or AsyncCallsQueue(
            persistent, process_group=process_group, background_finalize=True, **worker
        )
        root: CheckpointRoot | None = None
        self._upload: Uploader | None = None
        try:
            root = self._root = self._open_root(
                root_dir, keep_last, keep, process_group, coordinator_rank, self.read_only
            )
            self.root_dir = root.path
            self.keep_last = keep_last
            self.keep = keep
            self.process_group = process_group
            self.coordinator_rank = coordinator_rank
            self.callback = callback
            #: The :class:`asyncckpt.LoadTimings` of this rank's last :meth:`load` (``None`` before).
            self.last_load_timings: LoadTimings | None = None
            if self._owns_queue and isinstance(self.queue.caller, PersistentAsyncCaller) and not self.read_only:
                self.queue.caller.start()  # ready before the first save: no start-up stall
            self._saver = Saver(self.queue, self.options, root)
            self._upload = self._open_upload(upload_to, keep_remote, upload_failure, upload_timeout_s, upload_process)
            if local is not None:
                self.local = LocalCheckpoints(
                    local,
                    self.queue,
                    self.options,
                    process_group,
                    root=str(root.path),
                )
        except BaseException:
            # Nothing of this manager outlives the raise: the lock is released now (not
            # when the traceback, which holds this object, is collected), the queue closed.
            if root is not None:
                root.release_ownership()
            if self._owns_queue:
                self.queue.close(abort=True)
            raise
        # Dropped without close(): the pending saves still commit (a thread keeps the
        # saver and this manager's queue until they settle), then the staging buffers
        # are freed and the queue closed. At interpreter exit the exit hook bounds it.
        # The root's lock goes with the last save that can commit into it (the process's
        # exit releases it too).
        self._release = weakref.finalize(
            self,
            release_when_settled,
            self._saver,
            self.queue if self._owns_queue else None,
            root.release_ownership,
        )
        self._release.atexit = False
        self._closed = False

    @staticmethod
    def _open_root(
        root_dir: Any, keep_last: Any, keep: Any, process_group: Any, coordinator_rank: int, read_only: bool
    ) -> CheckpointRoot:
        """The root, its lock taken by the coordinator (unless ``read_only``: then nothing
        is created and a missing root is ``CheckpointNotFoundError``); a failure on any
        rank is raised, the same, on every rank (collective)."""
        sync = SyncGroup(process_group)
        if not 0 <= coordinator_rank < sync.world_size:
            raise InvalidArgumentError(
                f"coordinator_rank {coordinator_rank} is not a rank of the group (world size {sync.world_size})"
            )
        root: CheckpointRoot | None = None
        failure: RankFailure | None = None
        try:
            root = CheckpointRoot(root_dir, keep_last, keep=keep, create=not read_only)
            if not read_only and sync.rank == coordinator_rank:
                root.acquire_ownership()
        except AsyncckptError as exc:
            if not sync.active:
                raise
            failure = RankFailure.from_exception(exc)
        failures = sync.gather_failures(failure) if sync.active else {}
        if failures:
            if root is not None:
                root.release_ownership()
            first = failures[min(failures)]
            if isinstance(first.exception, AsyncckptError):
                raise first.exception
            raise CheckpointError(f"opening the checkpoint root {root_dir} failed: {first}", failures)
        assert root is not None
        return root

    def _open_upload(
        self, url: str | None, keep: int | None, failure: Any, timeout_s: float, process: bool = True
    ) -> Uploader | None:
        """The upload tier (``upload_to``), or ``None``; ``keep_remote`` and the other
        upload options without ``upload_to`` raise ``InvalidArgumentError``."""
        if url is None:
            return None
        sync = SyncGroup(self.process_group)
        return Uploader(
            self._root,
            url,
            keep_remote=keep,
            failure=failure,
            timeout_s=timeout_s,
            rank=sync.rank,
            coordinator=sync.rank == self.coordinator_rank,
            callback=self.callback,
            read_only=self.read_only,
            process=process,
        )

    @property
    def upload_to(self) -> str | None:
        """The remote tier's URL (``upload_to``), or ``None``."""
        return None if self._upload is None else self._upload.url

    def remote_steps(self) -> list[int]:
        """The steps committed in the remote tier (``upload_to``), ascending; ``[]``
        without one.

        Raises:
            RemoteStorageError: the remote tier cannot be listed.
        """
        return [] if self._upload is None else self._upload.tier.steps()

    def wait_uploads(self, timeout: float | None = None) -> bool:
        """Wait until every queued upload is done (its outcome reported to the
        callbacks); ``False`` if ``timeout`` seconds passed first. Not collective: on
        the coordinator a step's upload is done once its commit marker is written (the
        step exists remotely), on another rank once that rank's own objects are up. A
        rank that reads the remote step next meets the coordinator first (e.g.
        ``torch.distributed.barrier()`` after this call on every rank)."""
        return True if self._upload is None else self._upload.wait(timeout)

    @property
    def overlap_staging(self) -> bool:
        """Whether saves use overlapped staging (``options.overlap_staging``)."""
        return self.options.overlap_staging

    @property
    def last_committed_timings(self) -> SaveTimings | None:
        """Timings of the most recently committed save (``None`` before the first)."""
        return self._saver.last_committed_timings

    def step_dir(self, step: int) -> Path:
        """The directory of step ``step``."""
        return self._root.step_dir(step)

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``, the same answer on every rank, without a
        collective: ``if manager.should_save(step): manager.save(step, state)``.

        True when ``step`` is a multiple of ``save_interval.steps``; when the
        time-based save of ``save_interval.seconds`` is due; or when the
        ``PreemptionSave`` of this manager has agreed to stop (its ``reached`` returned
        True on every rank at the same step).

        Time is agreed through the saves (Orbax's ``save_interval_steps`` and
        ``EveryNSeconds`` in one call): the first call of a manager with ``seconds``
        says True (the clock starts at a save every rank took part in); each save then
        gathers every rank's seconds per step since the previous save (inside
        :meth:`save`'s collective call, one small all_gather) and schedules the next
        time-based save at the step where the slowest rank's ``seconds`` will have
        passed. So every rank answers the same, at the price of a schedule that
        follows the step time measured over the last interval.

        Args:
            step: the step about to be saved (or not); call it once per step, with
                increasing steps, on every rank.

        Raises:
            InvalidArgumentError: ``step`` is not a non-negative int.
        """
        step = check_step(step)
        preemption = self.preemption
        if preemption is not None and preemption.agreed_signum:
            return True
        interval = self.save_interval
        if interval is None:
            return False
        if interval.steps is not None and step % interval.steps == 0:
            return True
        if interval.seconds is not None:
            return self._timed_due is None or step >= self._timed_due
        return False

    def _agree_on_time(self, step: int) -> None:
        """(all ranks, in :meth:`save`) Schedule the next time-based save (see
        :meth:`should_save`): one all_gather of each rank's microseconds per step
        since its previous save."""
        now = time.monotonic()
        clock, self._clock = self._clock, (step, now)
        per_step_us = 0
        if clock is not None and step > clock[0]:
            per_step_us = int(1e6 * (now - clock[1]) / (step - clock[0]))
        sync = SyncGroup(self.process_group)
        rates = [row[0] for row in sync.all_gather_ints([per_step_us])] if sync.active else [per_step_us]
        assert self.save_interval is not None
        self._timed_due = self.save_interval.next_timed_step(step, [r / 1e6 for r in rates])

    @gc_paused()
    def save(
        self,
        step: int,
        state_dict: dict[str, Any],
        *,
        async_op: bool = True,
        callback: SaveCallback | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> SaveHandle:
        """Save ``state_dict`` as step ``step`` (see :func:`asyncckpt.save`).

        Args:
            step: the step number (names the directory ``step_%08d``).
            state_dict: the state (see :func:`asyncckpt.save`).
            async_op: stage and return (default), or write and commit first.
            callback: called once, in this process, after finalize, with the
                :class:`SaveResult` (committed) or the exception (failed); default
                the manager's ``callback``. It runs in the queue's finalizer thread
                (it must be thread-safe). If it raises, the error is logged and
                raised as :class:`CallbackError` by the next :meth:`maybe_finalize`,
                ``handle.wait`` or :meth:`close`; the queue goes on.
            metrics: numbers by name (``{"val_loss": 0.31}``), stored with the step
                (in its manifest; the coordinator's): ``BestN`` ranks steps by them,
                :meth:`metadata` reads them back without reading any tensor.
            metadata: a JSON-serializable ``dict`` (``str`` keys) stored the same way.

        Returns:
            The handle; committed steps are also reported by :meth:`maybe_finalize`.

        Raises:
            InvalidArgumentError: (a ``ValueError`` and ``TypeError``) ``step`` is not a
                non-negative int (``bool``, ``1.5``, ``"7"``, ``-1``; numpy / torch
                integer scalars are fine), ``state_dict`` not a dict, ``callback``
                not callable, or ``metrics`` / ``metadata`` of the wrong shape;
                nothing is staged.
            CheckpointError: invalid input, or step ``step`` already exists (on every
                rank).
            InvalidStateError: (a ``RuntimeError``) the manager is closed.
        """
        hint = "; the call is save(step, state_dict)"
        step = check_step(step, hint=hint)
        check_state_dict(state_dict, hint=hint)
        check_callback(callback)
        user_info = check_step_info(metrics, metadata)
        if self._closed:
            raise InvalidStateError("CheckpointManager is closed")
        if self.read_only:
            raise CheckpointError(f"this CheckpointManager of {self.root_dir} is read-only (read_only=True)")
        if self.save_interval is not None and self.save_interval.seconds is not None:
            self._agree_on_time(step)
        callback = callback if callback is not None else self.callback
        ticket = None
        if self._upload is not None:  # (whether the uploads fell behind: decided in the plan's collective)
            ticket = self._upload.ticket()
            callback = self._upload.wrap(callback, ticket)
        with self._saver.lock:
            return self._saver.save(
                state_dict,
                self.step_dir(step),
                async_op=async_op,
                process_group=self.process_group,
                coordinator_rank=self.coordinator_rank,
                step=step,
                callback=callback,
                user_info=user_info,
                share=() if ticket is None else ticket.share,
                on_shared=None if ticket is None else ticket.decide,
            )

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """What step ``step`` (default: the latest) was saved with, read from its
        manifest without reading any tensor (see :func:`asyncckpt.read_metadata`).

        Raises:
            InvalidArgumentError: ``step`` is not ``None`` or a non-negative int.
            CheckpointNotFoundError: there is no committed checkpoint of that step.
            CorruptCheckpointError: its manifest is unreadable or of a newer format.
        """
        if step is not None:
            step = check_step(step)
        else:
            step = self._root.latest()
            if step is None:
                raise CheckpointNotFoundError("no committed checkpoint", str(self.root_dir))
        path = self.step_dir(step)
        if not _manifest.is_committed(path):
            raise CheckpointNotFoundError(f"step {step} has no committed checkpoint", str(path))
        return read_metadata(path)

    @gc_paused()
    def prepare(self, state_dict: dict[str, Any]) -> int:
        """Get ready for saves of ``state_dict``'s structure before the first one (collective).

        Plans the save (the plan is cached), then allocates, page-faults and formats
        the staging buffers (all ``staging_buffers`` of them; pinned for CUDA
        tensors), so that no later ``save`` stalls longer than a steady one:
        allocating fresh host memory costs several times a copy into memory already
        mapped. With a local tier, its own staging buffer too (the first
        ``manager.local.save`` likewise). Nothing is written. Optional; call it e.g.
        after building the model and optimizer state.

        Args:
            state_dict: a state of the structure (keys, dtypes, shapes) to be saved.

        Returns:
            The bytes of host memory the staging buffers hold (this rank).

        Raises:
            CheckpointError: invalid input on any rank, or the memory guard
                (``staging_memory_limit``) refused the buffers (raised on every rank).
        """
        if self._closed:
            raise InvalidStateError("CheckpointManager is closed")
        if self.read_only:
            raise CheckpointError(f"this CheckpointManager of {self.root_dir} is read-only (read_only=True)")
        nbytes = self._saver.prepare(state_dict, self.process_group, self.coordinator_rank)
        if self.local is not None:
            nbytes += self.local.prepare(state_dict)
        return nbytes

    def synchronize_staging(self) -> None:
        """Make the state of an overlapped save free to change, and start its write once
        its copy is over.

        With ``overlap_staging=True``, call it after the next forward/backward and
        before ``optimizer.step()``: the state must not change while it is copied.
        The host waits for the copies of CPU tensors (the save's copy thread); the
        device-to-host copies of CUDA tensors are not waited for on the host: the
        current CUDA stream waits for them on the device (``cudaStreamWaitEvent``), so
        whatever this thread queues on it afterwards (the optimizer's step) runs after
        the copy, while the host goes on queuing work. The write starts here if the
        copy is over, else at the first :meth:`maybe_finalize` that finds it over (or
        the next save, ``wait`` or :meth:`close`). With a ``calls_queue`` finalized
        in the training loop (no background finalizer) it waits for the copy and
        starts the write on every rank: that queue's ranks must hand the save to the
        writer in the same call. The wait counts as the save's stall. The local
        tier's overlapped save too (``local=``). No-op when nothing is being staged.
        """
        self._saver.release_staging()
        if self.local is not None:
            self.local.synchronize_staging()

    def maybe_finalize(self, blocking: bool = False) -> list[int]:
        """Report the saves committed since the last call, and raise failures.

        No collective, no file I/O: the commit runs in the queue's finalizer thread,
        so ranks may call this any number of times (with a ``calls_queue`` finalized
        in the training loop it drives that queue, collectively).

        With ``overlap_staging=True``, a save whose copy is still running is left to
        run (its thread and CUDA event polled, the device never synchronized): its write
        starts at the first call that finds the copy over (the optimizer's step is
        ordered after the copy anyway, see :meth:`synchronize_staging`); with a
        ``calls_queue`` finalized in the training loop, over on every rank (one
        all_gather decides).

        Args:
            blocking: first wait until every pending save is committed or failed.

        Returns:
            The steps committed since the last call, in order (except those whose
            ``handle.wait()`` returned already; at most the newest 512 to 1024 of
            them: a loop that never calls this keeps bounded memory, see
            :data:`~asyncckpt.saving.saver.MAX_UNHARVESTED`).

        Raises:
            CheckpointException: a save failed on some rank (the same on every rank);
                nothing of it was committed, ``latest`` is unchanged, its temporary
                directory is removed. Later outcomes are reported by the next call.
                Not blocking, a failure behind saves committed since the last call is
                raised by the next call (these steps are returned now); blocking, it is
                raised now, with a note naming those steps (``steps()`` lists them).
            CallbackError: a completion callback raised (its save is committed).
        """
        if blocking or self._saver.staging_copied():
            self._saver.synchronize_staging()
        steps = [record.step for record in self._saver.harvest(blocking) if record.step is not None]
        self._saver.raise_callback_errors()
        if self._upload is not None:
            self._upload.report()
        return steps

    def steps(self) -> list[int]:
        """Committed steps, ascending (partial or temporary directories are ignored)."""
        return self._root.steps()

    def latest_step(self) -> int | None:
        """The step of the newest save committed (what to resume from), or ``None``.

        The newest *save*, not the largest step number: after a rollback (``load`` of
        step 10 while 20 exists, then saves 11, 12, 13) it is 13 (the rollback policy,
        :meth:`CheckpointRoot.commit_order`). A renamed step directory is complete (the
        rename is the commit), and ``latest`` is replaced only after it, so ``latest``
        can lag one save behind (a crash between the two) but never lead.
        """
        newest = self._newest()
        return None if newest is None else newest[0]

    def load(
        self,
        state_dict: dict[str, Any],
        step: int | None = None,
        *,
        verify: bool | Literal["inline"] = "inline",
        allow_pickle: bool = False,
        initial: str | os.PathLike | None = None,
    ) -> int:
        """Load step ``step`` (default: the latest) into ``state_dict`` in place (collective).

        Without ``step``, the coordinator picks the newest save over both tiers (the
        root, and the bucket of ``upload_to``) and every rank loads that one (one
        broadcast: the ranks never load different steps, and the bucket is listed
        once). ``verify`` and ``allow_pickle`` are those of :func:`asyncckpt.load`. An
        overlapped save still copying (perhaps the same tensors) is synchronized first,
        as ``save``, ``maybe_finalize``, ``close`` and ``prepare`` do.

        ``initial``: where a fresh run starts from when the manager has no committed
        step (and ``step`` is ``None``): anything :func:`asyncckpt.load` reads, e.g. a
        released model as a Hugging Face safetensors directory, a stock DCP checkpoint
        or an ``s3://`` URL. It is loaded into ``state_dict`` and ``-1`` is returned,
        the step before the first, so ``start = manager.load(state, initial=...) + 1``
        serves a fresh run and a resumed one alike.

        Returns:
            The step loaded, or ``-1`` for ``initial`` (its
            :class:`asyncckpt.LoadTimings` are then :attr:`last_load_timings`).

        Raises:
            InvalidArgumentError: (a ``ValueError`` and ``TypeError``) ``step`` is not
                ``None`` or a non-negative int, or ``state_dict`` not a dict.
            CheckpointNotFoundError: (a ``FileNotFoundError``) there is no committed
                checkpoint (or not that step), or it was removed while being loaded.
            CorruptCheckpointError: the checkpoint does not match its manifest, or
                names a path outside its directory.
            CheckpointError: a non-tensor value needs ``allow_pickle=True``; the
                coordinator could not list the root to choose the step.
        """
        hint = "; the call is load(state_dict, step)"
        check_state_dict(state_dict, hint=hint)
        if step is not None:
            step = check_step(step, hint=hint)
        self._saver.hand_off_overlapped()  # never load into tensors an overlapped copy still reads (any tier's)
        where: str | None = None
        if step is None:
            choice = self._agreed_newest()
            if choice is None and initial is not None:  # a fresh run: its starting point
                self.last_load_timings = load(
                    state_dict, initial, process_group=self.process_group, verify=verify, allow_pickle=allow_pickle
                )
                return -1
            if choice is None:
                raise CheckpointNotFoundError("no committed checkpoint", str(self.root_dir))
            step, where = choice
        self._load_from(state_dict, step, where, verify, allow_pickle)
        return int(step)

    def _load_from(
        self,
        state_dict: dict[str, Any],
        step: int,
        where: str | None,
        verify: bool | Literal["inline"] = "inline",
        allow_pickle: bool = False,
    ) -> str:
        """Load ``step`` from ``where`` (a URL), or from the root (``None``; from the
        remote tier when the root does not hold it); returns what it read (the step's
        directory or URL)."""
        source = self._source(step, where)
        self.last_load_timings = load(
            state_dict, source, process_group=self.process_group, verify=verify, allow_pickle=allow_pickle
        )
        return source

    def _source(self, step: int, where: str | None) -> str:
        """Where :meth:`_load_from` reads ``step``: ``where`` (a URL), else its
        directory in the root, else its URL in the remote tier.

        Raises:
            CheckpointNotFoundError: neither tier holds ``step``.
        """
        path = self.step_dir(step)
        if where is None and not _manifest.is_committed(path) and self._upload is not None:
            where = self._upload.remote_url(step)  # only in the remote tier
        if where is None and not _manifest.is_committed(path):
            raise CheckpointNotFoundError(f"step {step} has no committed checkpoint", str(path))
        return str(path) if where is None else where

    def _newest(self) -> tuple[int, str | None] | None:
        """The newest save over both tiers, as this rank sees them: ``(step, None)`` in
        the root, ``(step, url)`` only (or newer) in the remote tier; ``None``: none."""
        if self._upload is not None:
            newest = self._upload.newest(self._root.latest())
            return None if newest is None else (newest[0], None if newest[1] == "local" else newest[1])
        local = self._root.latest()
        return None if local is None else (local, None)

    def _agreed_newest(self) -> tuple[int, str | None] | None:
        """(collective) :meth:`_newest` as the coordinator sees it, on every rank: one
        rank lists the root and the bucket (a remote listing is a LIST and a HEAD per
        new marker: once per job, not once per rank), and no rank loads another step
        than the others because a listing differed (an upload committing meanwhile, a
        bucket one rank cannot reach).

        Raises:
            CheckpointError: the coordinator could not list (the same on every rank).
        """
        sync = SyncGroup(self.process_group)
        if not sync.active:
            return self._newest()
        choice: tuple[int, str | None] | None = None
        error: str | None = None
        if sync.rank == self.coordinator_rank:
            try:
                choice = self._newest()
            except (AsyncckptError, OSError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        with sync.describing("the choice of the step to load (the coordinator's)"):
            choice, error = sync.broadcast_object((choice, error), self.coordinator_rank)
        if error is not None:
            raise CheckpointError(f"rank {self.coordinator_rank} could not choose the step to load: {error}")
        return choice

    @gc_paused()
    def restore(self, state_dict: dict[str, Any]) -> RestoreResult | None:
        """Restore the newest checkpoint of either tier into ``state_dict`` (collective).

        The persistent tiers' newest save (the root's, or the bucket's of ``upload_to``)
        is chosen as :meth:`load` chooses it (by the coordinator, for every rank).
        Without a local tier, that is restored. With one: see
        :meth:`asyncckpt.replication.LocalCheckpoints.restore` (one collective census,
        peers send missing shards, every byte CRC-checked, a bad copy falls back to a
        replica, then to the persistent tiers' newest). The result is also logged
        (rank 0) and kept as ``manager.local.restored``.

        Returns:
            The step, tier and peers restored from (for the persistent tier, its
            ``location``: the step's directory or ``s3://`` URL), or ``None`` when no
            tier holds a checkpoint (start from step 0).
        """
        self._saver.hand_off_overlapped()  # never restore into tensors an overlapped copy still reads (any tier's)
        choice = self._agreed_newest()  # the persistent tiers' newest, the same on every rank
        if self.local is None:
            if choice is None:
                return None
            step, where = choice
            location = self._load_from(state_dict, step, where)
            return RestoreResult(int(step), "persistent", {}, "persistent", location=location)
        where = None if choice is None else choice[1]
        return self.local.restore(
            state_dict,
            None if choice is None else choice[0],
            lambda step: self._load_from(state_dict, step, where),
        )

    def close(self, abort: bool = False) -> None:
        """Commit pending saves and stop the worker; ``abort`` drops them instead.

        Idempotent. Frees the staging buffers, also when the queue was passed in
        (``calls_queue``; that queue stays open). With ``abort=True``: no collective,
        the worker is terminated, pending saves are dropped (their handles fail, their
        temporary directories are removed); on a queue passed in they stay that
        queue's, and their handles settle with what it makes of them.

        A manager dropped without ``close()`` (garbage-collected) still commits its
        pending saves and settles their handles (a failure is named on logger
        ``asyncckpt``), then frees its buffers and stops its worker.

        Raises:
            CheckpointException: (``abort=False``) a pending save failed (the first
                one not reported yet; the manager is closed anyway).
            CallbackError: (``abort=False``) a completion callback raised.
            KeyboardInterrupt: Ctrl-C while waiting: the pending saves are dropped at
                once (as with ``abort=True``), then the interrupt is re-raised.
        """
        if self._closed:
            return
        self._closed = True
        if self.local is not None:
            self.local.close(abort)
        first_error: BaseException | None = None
        try:
            if not abort:
                self._saver.synchronize_staging()
                self._saver.wait_all()
                while True:  # report every outcome; raise the first failure
                    try:
                        if not self._saver.harvest(blocking=False):
                            break
                    except CheckpointException as exc:
                        first_error = first_error or exc
        except BaseException as exc:
            if not isinstance(exc, Exception):
                abort = True  # interrupted (Ctrl-C): drop the pending saves at once
            raise
        finally:
            if self._upload is not None:  # the uploads of the saves just committed, bounded
                self._upload.close(0 if abort else None)
            if self._owns_queue:
                try:
                    self.queue.close(abort=abort)
                except CheckpointException as exc:  # not a save of this manager (those are harvested above):
                    first_error = first_error or exc  # a call scheduled on its queue by the user
            self._root.join_deletion()
            if self._release.detach() is not None:
                # The staging buffers, whoever owns the queue; a queue passed in may still
                # hold saves of this manager (abort=True): freed once they settle.
                # The root's lock goes with them: another manager may open it then.
                release_when_settled(self._saver, None, self._root.release_ownership)
        if first_error is not None:
            raise first_error
        if not abort:
            self._saver.raise_callback_errors()
            if self._upload is not None:
                self._upload.report()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, _tb: Any) -> None:
        """Close the manager at the end of a ``with`` block.

        Without an exception: :meth:`close` (pending saves commit, failures raise).
        With an ``Exception`` (a training loop that crashed) or ``SystemExit`` (other
        than :class:`~asyncckpt.errors.PreemptionBudgetExpired`): every
        save staged before it still commits, for up to ``ASYNCCKPT_EXIT_TIMEOUT_S``
        seconds (default 5, the interpreter exit's bound); each one that failed or is
        still pending then (dropped) is named in a warning on logger ``asyncckpt``,
        and nothing raised here replaces the block's exception. With
        ``KeyboardInterrupt`` (or the preemption budget running out): the pending saves
        are dropped at once, as ``close(abort=True)``.
        """
        if exc_type is None:
            self.close()
            return
        if (
            issubclass(exc_type, PreemptionBudgetExpired)
            or not issubclass(exc_type, (Exception, SystemExit))
            or self._closed
        ):
            self.close(abort=True)
            return
        when = f"when the `with CheckpointManager` block of {self.root_dir} ended with {exc_type.__name__}"
        try:
            bound = exit_timeout()
            lost = self._saver.settle_within(bound, when)
            if self._upload is not None:  # a crash: the uploads get the exit's bound too (then resumed at start)
                self._upload.close(bound, bound=f"{bound:g} s after {exc_type.__name__} ({EXIT_TIMEOUT_ENV})")
            if self.local is not None:
                lost += self.local.settle_within(bound, when)
        except BaseException:
            self.close(abort=True)  # interrupted while waiting (Ctrl-C): drop at once
            raise
        try:
            self.close(abort=bool(lost))
        except Exception as error:  # noqa: BLE001 - named above; the block's exception goes on
            _log.debug("close() after the block's %s raised %s: %s", exc_type.__name__, type(error).__name__, error)
