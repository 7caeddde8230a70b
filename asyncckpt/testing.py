"""Test hooks: what asyncckpt's own tests must see or break that no public API shows.

Not part of the API: used only by ``tests/``, and may change with the internals it
reads. Everything a test can observe through the public API (handles, timings,
``CheckpointManager`` methods, the files on disk, ``asyncckpt.verify``, stock DCP) is
observed there; faults a process can be told through its environment are failpoints
(``ASYNCCKPT_FAULT``, :mod:`asyncckpt._faults`). What is left is here, in one place:

- :func:`staging_buffers`: the host staging buffers a saver holds (their memory is the
  point of several tests: released, bounded, pinned);
- :func:`held_staging_bytes`: the bytes of staging memory held now, by one owner or by
  the whole process (the memory a synchronous save must not keep);
- :func:`pending_steps`: the saves a manager still tracks (a settled save must not stay);
- :func:`lose_held_layouts`: a fault, a coordinator that no longer holds the file
  layouts the ranks sent it (as after a restart of its process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncckpt.manager import CheckpointManager
    from asyncckpt.saving.saver import Saver
    from asyncckpt.saving.staging import StagingBuffer

__all__ = ["staging_buffers", "held_staging_bytes", "pending_steps", "lose_held_layouts"]


def _savers(owner: Any) -> list[Saver]:
    from asyncckpt.async_utils.calls_queue import AsyncCallsQueue
    from asyncckpt.manager import CheckpointManager

    if isinstance(owner, CheckpointManager):  # (and its local tier's, which stages into buffers of its own)
        return [owner._saver] + ([owner.local._saver] if owner.local is not None else [])
    if isinstance(owner, AsyncCallsQueue):
        from asyncckpt.saving.api import _savers

        return list(_savers.get(owner, {}).values())  # one saver per SaveOptions used on the queue
    raise TypeError(f"expected a CheckpointManager or an AsyncCallsQueue, not {type(owner).__name__}")


def staging_buffers(owner: CheckpointManager | Any) -> tuple[StagingBuffer, ...]:
    """The host staging buffers ``owner``'s saves hold now, oldest first.

    Args:
        owner: a ``CheckpointManager`` (its local tier's buffers after its own), or the
            ``AsyncCallsQueue`` given to ``asyncckpt.save(..., calls_queue=)`` (the
            buffers of every ``SaveOptions`` used on it; no save on it yet: none).

    Returns:
        The buffers (``StagingBuffer``: ``slab_id``, ``nbytes``, ``pinned``, ``ref``).

    Raises:
        TypeError: ``owner`` is neither.
    """
    return tuple(buffer for saver in _savers(owner) for buffer in saver.pool.buffers)


def held_staging_bytes(owner: CheckpointManager | Any = None) -> int:
    """Bytes of host staging memory (``StagingBuffer.nbytes``, whole pages) held now.

    Args:
        owner: a ``CheckpointManager`` or an ``AsyncCallsQueue`` (as for
            :func:`staging_buffers`), or ``None``: every saver of this process (every
            manager's, and those ``asyncckpt.save`` keeps per queue and ``SaveOptions``).

    Raises:
        TypeError: ``owner`` is none of these.
    """
    if owner is None:
        from asyncckpt.saving.pending import _live_savers
        from asyncckpt.saving.saver import Saver

        savers = [saver for saver in _live_savers if isinstance(saver, Saver)]
    else:
        savers = _savers(owner)
    return sum(buffer.nbytes for saver in savers for buffer in saver.pool.buffers)


def pending_steps(manager: CheckpointManager) -> list[int]:
    """The steps of the saves ``manager`` still tracks (scheduled, not yet reported)."""
    return manager._saver.pending_steps()


def lose_held_layouts(manager: CheckpointManager) -> None:
    """Fault: the coordinator forgets every rank's file layout it holds, so that the
    next commit in which a rank sends only its layout token fails (naming the rank).
    Call it on the coordinator rank, between saves."""
    exchange = manager._saver.layout_exchange
    exchange._held.clear()
    exchange._merged = None
