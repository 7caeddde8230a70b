"""SaveHandle: the future of one save, and what a save reports (timings, result).

A :class:`SaveHandle` is a :class:`concurrent.futures.Future` whose result is the
save's :class:`SaveResult`. Whoever runs the save (the saver, ``asyncckpt.saving.saver``)
completes it once, with ``set_result`` or ``set_exception``, when the queue settles the
save's call (docs/DESIGN.md, "the save's life"). Reading its state (:meth:`done`,
``result(timeout=0)``) never runs a commit nor any file I/O; only the blocking calls
(:meth:`SaveHandle.wait`, :meth:`result`, :meth:`exception` with a timeout other than
0) may drive a queue finalized in the training loop, through the handle's
:class:`SaveDriver`. This module imports nothing of the saver: the driver is the
whole interface between the two.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from asyncckpt.errors import CheckpointTimeoutError, InvalidArgumentError, SaveDeadlockError

__all__ = ["SaveTimings", "SaveResult", "SaveCallback", "SaveDriver", "SaveHandle"]


class SaveTimings(NamedTuple):
    """Timings of one save, taken when it completes (not when it is scheduled: DESIGN.md, known failure 9).

    Attributes:
        stall_s: seconds the calling thread was blocked in ``save()`` (planning +
            staging copy + scheduling; with overlapped staging, also the wait in
            ``synchronize_staging``).
        write_s: seconds the slowest rank spent writing and fsyncing its files.
        finalize_s: seconds of the commit (gather, metadata, manifest, rename,
            ``latest``), in the background finalizer.
        total_s: seconds from the ``save()`` call until committed.
        bytes: bytes written by all ranks (data files; metadata, manifest excluded).
        gbps: ``bytes / write_s / 1e9`` (GB/s, decimal).
        plan_s: seconds of this rank's plan phase (validation, the plan collective,
            the layout), part of ``stall_s``.
        stage_s: seconds of this rank's staging copies into host buffers, part of
            ``stall_s`` (with ``overlap_staging=True`` the copy thread's time too,
            which overlaps training: then it may exceed ``stall_s``).
        commit_s: seconds of the coordinator's ``storage.commit`` (``.metadata``,
            manifest, fsyncs, the rename), part of ``finalize_s``; 0.0 on the other
            ranks (it is not broadcast: no collective is added for it).

    The phases are those of :mod:`asyncckpt.saving.phases` (plan, stage, write,
    commit; finalize is the whole commit phase), the breakdown Megatron-core and
    PyTorch DCP's async save log; the last three fields come last, so positional
    unpacking of the first six is unchanged.
    """

    stall_s: float
    write_s: float
    finalize_s: float
    total_s: float
    bytes: int
    gbps: float
    plan_s: float = 0.0
    stage_s: float = 0.0
    commit_s: float = 0.0


class SaveResult(NamedTuple):
    """What a committed save produced: the result of its :class:`SaveHandle`, and what a
    completion callback receives.

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


#: A completion callback: called once, in the training process, after finalize, with
#: the :class:`SaveResult` of a committed save or the exception of a failed one. It
#: runs in the thread that settled the save: the queue's finalizer thread for
#: ``CheckpointManager`` and ``asyncckpt.save`` (so it must be thread-safe), the
#: calling thread for a synchronous save or a queue finalized in the training loop.
#: It runs before the handle is completed: a ``wait()`` that returns has seen it run.
SaveCallback = Callable[["SaveResult | BaseException"], None]


class SaveDriver(Protocol):
    """What a :class:`SaveHandle` asks of whoever runs its save (one driver per save).

    The saver gives each handle one; a handle without a driver (``None``) is completed
    by its creator alone. No method runs a commit unless named so.
    """

    @property
    def call_idx(self) -> int | None:
        """The save's call in its queue; ``None`` until scheduled, and for a synchronous save."""

    def synchronize_staging(self) -> None:
        """Finish this save's overlapped staging copy and hand it to the writer (no-op
        once handed, and for a save that is not overlapped)."""

    def drive(self, timeout: float | None) -> None:
        """(blocking path only) With a queue finalized in the training loop, finalize
        the queue's calls up to this save (collective; may commit); else nothing.

        Raises:
            TimeoutError: this rank's write did not finish within ``timeout`` seconds.
        """

    def reported(self) -> None:
        """The user saw this save's outcome: its owner's harvest (``maybe_finalize``)
        does not report it again."""

    def check_callbacks(self, error: BaseException | None) -> None:
        """Report the completion-callback errors pending on the owner: as notes of
        ``error`` (the save's failure, raised by the caller), or raised.

        Raises:
            CallbackError: (``error`` is ``None``) a completion callback raised.
        """

    def waits_on_itself(self) -> bool:
        """True when the calling thread is the one that must settle this save (it runs
        the save's completion callback now, or it is the queue's background finalizer
        thread): a blocking wait here would never return."""


class SaveHandle(concurrent.futures.Future[SaveResult]):
    """The future of one save: a :class:`concurrent.futures.Future` of its :class:`SaveResult`.

    ``result(timeout)``, ``exception(timeout)``, ``done()`` and
    ``add_done_callback(fn)`` behave as for any future; ``fn`` runs in the thread
    that completed the save (the queue's finalizer thread in the background). A save
    cannot be cancelled: it is running from its creation, ``cancel()`` returns False.

    With a queue finalized in the training loop nothing completes a save until the
    loop finalizes (``maybe_finalize``): :meth:`wait`, and :meth:`result` /
    :meth:`exception` with a timeout other than 0, do that (collective across the
    ranks); :meth:`done` and ``result(timeout=0)`` only read the state.

    Attributes:
        checkpoint_dir: the final (committed) path.
        step: the step (``CheckpointManager`` saves), else ``None``.
    """

    def __init__(self, checkpoint_dir: Path, step: int | None, driver: SaveDriver | None = None) -> None:
        super().__init__()
        self.checkpoint_dir = checkpoint_dir
        self.step = step
        self._driver = driver
        self.set_running_or_notify_cancel()  # a save runs from its creation: never cancelled

    # ------------------------------------------------------------------ the future
    @property
    def call_idx(self) -> int | None:
        """The save's call in its queue (``None`` for a synchronous save, and for an
        overlapped save until its staging is synchronized)."""
        return self._driver.call_idx if self._driver is not None else None

    @property
    def path(self) -> Path:
        """The final (committed) path (``checkpoint_dir``)."""
        return self.checkpoint_dir

    @property
    def timings(self) -> SaveTimings | None:
        """The :class:`SaveTimings` once committed, else ``None`` (pending, or failed)."""
        if not self.done() or super().exception(timeout=0) is not None:
            return None
        result: SaveResult = super().result(timeout=0)
        return result.timings

    def cancel(self) -> bool:
        """A save cannot be cancelled once created: always False (nothing changes)."""
        return False

    def _drive(self, timeout: float | None) -> None:
        if timeout == 0 or self.done() or self._driver is None:
            return
        if self._driver.waits_on_itself():
            raise SaveDeadlockError(
                f"waiting for the save of {self.checkpoint_dir} in the thread that must settle it (its "
                "completion callback, or its queue's finalizer thread) would never return; check "
                "handle.done() there, or wait from another thread"
            )
        self._driver.synchronize_staging()
        if not self.done():
            self._driver.drive(timeout)

    def result(self, timeout: float | None = None) -> SaveResult:
        """The save's :class:`SaveResult`, once committed on all ranks.

        Unlike :meth:`wait`, the outcome does not count as reported: a failure is also
        raised by ``CheckpointManager.maybe_finalize``, and completion-callback errors
        are left to :meth:`wait`, ``maybe_finalize`` and ``close``.

        Args:
            timeout: seconds to wait (``None``: no limit; 0: only read the state).

        Raises:
            CheckpointException: this save failed (on any rank).
            CheckpointTimeoutError: (a ``TimeoutError``) not completed within ``timeout``
                seconds (the save goes on).
            SaveDeadlockError: (``timeout`` other than 0) called where the save must
                be settled: in its completion callback, or its queue's finalizer thread.
        """
        self._drive(timeout)
        try:
            result: SaveResult = super().result(timeout)  # raises the save's failure
        except concurrent.futures.TimeoutError:
            if self.done():
                raise  # the save's own failure
            raise self._timed_out(timeout) from None
        return result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's failure, or ``None`` once committed (``Future.exception``); as for
        :meth:`result`, the outcome does not count as reported.

        Args:
            timeout: seconds to wait (``None``: no limit; 0: only read the state).

        Raises:
            CheckpointTimeoutError: (a ``TimeoutError``) not completed within ``timeout`` seconds.
            SaveDeadlockError: (``timeout`` other than 0) called where the save must
                be settled: in its completion callback, or its queue's finalizer thread.
        """
        self._drive(timeout)
        try:
            return super().exception(timeout)
        except concurrent.futures.TimeoutError:
            raise self._timed_out(timeout) from None

    def _timed_out(self, timeout: float | None) -> CheckpointTimeoutError:
        return CheckpointTimeoutError(f"the save of {self.checkpoint_dir} was not committed within {timeout} s")

    # ------------------------------------------------------------------ the save's API
    def synchronize_staging(self) -> None:
        """Wait until the state is staged, then start the write (overlapped saves).

        With ``overlap_staging=True`` the copy into host buffers runs while training
        goes on (the next forward/backward); call this before the state is mutated
        (before ``optimizer.step()``). Every rank calls it (or a later ``save``,
        ``wait``, ``maybe_finalize`` or ``close``, which call it implicitly), in the
        same order as its saves. The time spent here counts as stall. No-op for other
        saves.
        """
        if self._driver is not None:
            self._driver.synchronize_staging()

    def wait(self, timeout: float | None = None) -> SaveTimings:
        """Block until the checkpoint is committed on all ranks.

        Synchronizes an overlapped staging first. With a queue finalized in the
        training loop this finalizes, in order, every earlier pending call too
        (collective); with the default background finalization it only waits.

        Args:
            timeout: seconds to wait (``None``: no limit).

        Returns:
            The save's timings.

        Raises:
            CheckpointException: this save failed (on any rank).
            CallbackError: a completion callback of this or an earlier save raised
                (the checkpoint itself is committed).
            CheckpointTimeoutError: (a ``TimeoutError``) not settled within ``timeout``
                seconds (the save goes on).
            SaveDeadlockError: called where the save must be settled, before it is: in
                its own completion callback (which runs before the handle completes),
                or in its queue's finalizer thread (another save's callback). Raised at
                once; the save goes on.
        """
        try:
            self._drive(timeout)
            error = super().exception(timeout)
        except concurrent.futures.TimeoutError:
            raise self._timed_out(timeout) from None
        if self._driver is not None:
            self._driver.reported()
            self._driver.check_callbacks(error)
        if error is not None:
            raise error
        result: SaveResult = super().result(timeout=0)
        return result.timings

    def __repr__(self) -> str:
        state = "pending" if not self.done() else "failed" if super().exception(timeout=0) is not None else "committed"
        return f"SaveHandle({str(self.checkpoint_dir)!r}, {state})"

    def __reduce__(self) -> Any:
        raise InvalidArgumentError("a SaveHandle belongs to the process that saved; it cannot be pickled")
