"""Overlapped staging: the CPU copies of a save run in a thread while the training step runs."""

from __future__ import annotations

import threading
from typing import Any

import torch

from asyncckpt.errors import CheckpointError
from asyncckpt.saving import staging as _staging
from asyncckpt.saving.record import SaveInFlight

# ====================================================================== the saver
#: With overlapped staging, CPU tensors up to this size (bytes) are copied before
#: ``save`` returns: buffers such as BatchNorm's running statistics change in the next
#: forward, before ``synchronize_staging``, and cost little to copy at once.
OVERLAP_SYNC_BYTES = 1 << 20


def _small(t: torch.Tensor) -> bool:
    return not t.is_cuda and t.numel() * t.element_size() <= OVERLAP_SYNC_BYTES


class _Overlapped:
    """An overlapped staging: the large CPU copies run in a thread while training goes on.

    Every tensor copied after ``save`` returned is watched through its version counter
    (``Tensor._version``, shared with the views and detached copies the plan holds; for
    a DTensor, its local tensor's): one modified in place before the copy was
    synchronized fails the save, naming its keys, instead of committing torn data.

    And every optimizer's step is ordered after the copy before it changes a parameter
    (a global step pre-hook, :func:`asyncckpt.saving.staging.watch_copy`): fused kernels
    and updates through ``.data`` bump no version counter. The versions are compared
    once, when the copy is over or ordered before the state changes
    (:meth:`wait_copied`, :meth:`order_before_update`); later changes cannot tear it.
    """

    def __init__(self, save: SaveInFlight, run: Any, event: Any = None) -> None:
        self.save = save
        data = save.planned.data
        self.watched = (
            [(item, data[item], data[item]._version) for item, _ in save.buffer.views if not _small(data[item])]
            if save.buffer is not None
            else []
        )
        self.error: BaseException | None = None
        self._event = event  # the D2H copies' CUDA event, or None
        self._lock = threading.Lock()
        self._copied = False
        self.thread = threading.Thread(target=self._run, args=(run,), name="asyncckpt-staging", daemon=True)
        self.thread.start()
        _staging.watch_copy(self)  # after start(): the hook joins the thread

    def _run(self, run: Any) -> None:
        try:
            run()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the request's preload_fn
            self.error = exc

    def copied(self) -> bool:
        """Whether the copy is over (its thread done, the D2H copies' CUDA event
        complete), polled: never waits, never synchronizes the device."""
        return not self.thread.is_alive() and (self._event is None or bool(self._event.query()))

    def wait_copied(self) -> None:
        """Wait until the copy is over (the thread's CPU copies and the D2H copies), then
        compare the versions once and stop watching (any thread; idempotent): before the
        writer reads the staging buffer.

        A change seen then is kept in :attr:`error` (raised by the save's preload)."""
        if threading.current_thread() is self.thread:
            return
        self.thread.join()
        if self._event is not None and not self._event.query():
            self._event.synchronize()
        self._compare_once()

    def order_before_update(self) -> None:
        """Make the state free to change, without waiting for the device: join the
        thread's CPU copies (the host writes those), and order the calling thread's
        current CUDA stream after the D2H copies still running (``cudaStreamWaitEvent``:
        the device waits, the host does not), then compare the versions once and stop
        watching (any thread; idempotent). The optimizer's step pre-hook and the
        training loop's ``synchronize_staging()`` call it.

        In a loop whose host runs ahead of the device (the usual case), the copy is
        queued behind steps the device has not run yet: a host wait here would idle the
        host until the device caught up, for nothing. The device runs the copy before
        the kernels queued after this call (the optimizer's update), as it would after
        a host wait. Work queued on another stream after this call is not ordered
        (write the saved tensors through the current stream until the save is written).
        """
        if threading.current_thread() is self.thread:
            return
        self.thread.join()
        event = self._event
        if event is not None and not event.query():
            torch.cuda.current_stream().wait_event(event)
        self._compare_once()

    def _compare_once(self) -> None:
        with self._lock:
            if self._copied:
                return
            try:
                self.check_unmodified()
            except CheckpointError as exc:
                self.error = self.error or exc
            self.watched = []
            self._copied = True
        _staging.unwatch_copy(self)

    def check_unmodified(self) -> None:
        """Raise if a watched tensor was modified in place during its copy.

        Raises:
            CheckpointError: naming the state_dict keys that changed.
        """
        items = self.save.planned.plan.items
        changed = [items[item].index.fqn for item, tensor, version in self.watched if tensor._version != version]
        if changed:
            shown = ", ".join(repr(k) for k in changed[:8]) + (
                f" and {len(changed) - 8} more" if len(changed) > 8 else ""
            )
            raise CheckpointError(
                f"overlapped staging: {shown} changed in place before synchronize_staging(); the checkpoint "
                "would mix two steps, so it is not written. Call synchronize_staging() before the state "
                "changes (before optimizer.step()), or save without overlap_staging"
            )
