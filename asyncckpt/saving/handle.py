"""SaveHandle: the future of one save, and what a save reports (timings, result).

A handle changes state only through its own methods: scheduled (``call_idx``), then
settled once, committed (:class:`SaveTimings`) or failed (the exception). With a queue
that finalizes in the background (``CheckpointManager``, ``asyncckpt.save``) it settles
by itself; :meth:`SaveHandle.wait` on one rank works while the others keep training.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from asyncckpt.errors import CheckpointError, CheckpointException

if TYPE_CHECKING:
    from asyncckpt.saving.saver import Saver

__all__ = ["SaveTimings", "SaveResult", "SaveCallback", "SaveHandle"]


class SaveTimings(NamedTuple):
    """Timings of one save, measured at completion (DESIGN.md: known failure 9).

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


#: A completion callback: called once, in the training process, after finalize, with
#: the :class:`SaveResult` of a committed save or the exception of a failed one. It
#: runs in the thread that settled the save: the queue's finalizer thread for
#: ``CheckpointManager`` and ``asyncckpt.save`` (so it must be thread-safe), the
#: calling thread for a synchronous save or a queue finalized in the training loop.
SaveCallback = Callable[["SaveResult | BaseException"], None]


class SaveHandle:
    """A future-like handle of one save (``torch.futures.Future``-like: ``done``, ``wait``).

    Attributes:
        checkpoint_dir: the final (committed) path.
        call_idx: the call in the queue (``None`` for a synchronous save, and for an
            overlapped save until its staging is synchronized).
        step: the step (``CheckpointManager`` saves), else ``None``.
        timings: :class:`SaveTimings` once committed, else ``None``.
    """

    def __init__(self, checkpoint_dir: Path, step: int | None, started: float,
                 callback: SaveCallback | None, saver: "Saver | None") -> None:
        self.checkpoint_dir = checkpoint_dir
        self.step = step
        self.call_idx: int | None = None
        self.timings: SaveTimings | None = None
        self._started = started
        self._stall_s = 0.0
        self._settled = threading.Event()
        self._exception: BaseException | None = None
        self._callback = callback
        self._saver = saver
        self._staging = False  # an overlapped staging copy is in flight

    # ------------------------------------------------------------------ state changes
    def _add_stall(self, seconds: float) -> None:
        self._stall_s += seconds

    def _set_staging(self, in_flight: bool) -> None:
        self._staging = in_flight

    def _set_scheduled(self, call_idx: int) -> None:
        self.call_idx = call_idx

    def _commit_timings(self, write_s: float, finalize_s: float, nbytes: int) -> SaveTimings:
        """The timings of this save, committed now."""
        total = time.monotonic() - self._started
        return SaveTimings(stall_s=self._stall_s, write_s=write_s, finalize_s=finalize_s, total_s=total,
                           bytes=nbytes, gbps=nbytes / write_s / 1e9 if write_s > 0 else 0.0)

    def _settle(self, timings: SaveTimings | None = None, exception: BaseException | None = None) -> bool:
        """Mark committed (``timings``) or failed (``exception``), once.

        Returns:
            False if the handle was settled already (nothing changed).
        """
        if self._settled.is_set():
            return False
        self.timings, self._exception = timings, exception
        self._settled.set()
        return True

    def _wait_settled(self, timeout: float | None = None) -> bool:
        """Wait until committed or failed, raising nothing; False on timeout."""
        return self._settled.wait(timeout)

    def _take_callback(self) -> SaveCallback | None:
        """The completion callback, handed out once."""
        callback, self._callback = self._callback, None
        return callback

    # ------------------------------------------------------------------ public
    def synchronize_staging(self) -> None:
        """Wait until the state is staged, then start the write (overlapped saves).

        With ``overlap_staging=True`` the copy into host buffers runs while training
        goes on (the next forward/backward); call this before the state is mutated
        (before ``optimizer.step()``). Every rank calls it (or a later ``save``,
        ``wait``, ``maybe_finalize`` or ``close``, which call it implicitly), in the
        same order as its saves. The time spent here counts as stall. No-op for other
        saves.
        """
        if self._staging and self._saver is not None:
            self._saver.synchronize_staging()

    def done(self) -> bool:
        """True once the save was committed or failed.

        With a queue that finalizes in the background (the default) this turns true
        by itself. With a queue finalized in the training loop, finalization happens
        in :meth:`wait`, ``CheckpointManager.maybe_finalize`` or
        ``AsyncCallsQueue.maybe_finalize_async_calls``; in a single process this
        call also makes progress, without blocking.
        """
        if not self._settled.is_set() and self._saver is not None:
            self._saver.poll_foreground(self)
        return self._settled.is_set()

    def exception(self) -> BaseException | None:
        """The save's exception if it failed (``None`` if committed or pending)."""
        return self._exception if self._settled.is_set() else None

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
            TimeoutError: not settled within ``timeout`` seconds (the save goes on).
        """
        self.synchronize_staging()
        saver = self._saver
        if not self._settled.is_set() and saver is not None:
            saver.drive_foreground(self, timeout)
        if not self._settled.wait(timeout):
            raise TimeoutError(f"the save of {self.checkpoint_dir} was not committed within {timeout} s")
        if self._exception is not None:
            if saver is not None:
                saver.mark_reported(self)
                if isinstance(self._exception, CheckpointException):
                    saver.attach_callback_errors(self._exception)
            raise self._exception
        if saver is not None:
            saver.mark_reported(self)
            saver.raise_callback_errors()
        if self.timings is None:
            raise CheckpointError(f"the save of {self.checkpoint_dir} was dropped before it was finalized")
        return self.timings

    def __repr__(self) -> str:
        state = ("pending" if not self._settled.is_set()
                 else "failed" if self._exception is not None else "committed")
        return f"SaveHandle({str(self.checkpoint_dir)!r}, {state})"

    def __reduce__(self) -> Any:
        raise TypeError("a SaveHandle belongs to the process that saved; it cannot be pickled")
