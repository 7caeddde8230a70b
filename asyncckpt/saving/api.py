"""The free function asyncckpt.save() and the default queue per process group."""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from asyncckpt._check import check_path, check_state_dict, check_step
from asyncckpt.async_utils.calls_queue import AsyncCallsQueue
from asyncckpt.errors import InvalidArgumentError
from asyncckpt.options import SaveOptions
from asyncckpt.saving.handle import SaveCallback, SaveHandle
from asyncckpt.saving.saver import Saver

# ====================================================================== free functions
#: The savers of each queue, one per distinct SaveOptions: a call's options= decide
#: which saver runs it and never change another saver's (its staging buffers, copy
#: threads and plan cache stay those of its options).
_savers: weakref.WeakKeyDictionary[AsyncCallsQueue, dict[SaveOptions, Saver]] = weakref.WeakKeyDictionary()
_default_queues: dict[int, tuple[Any, AsyncCallsQueue]] = {}
_module_lock = threading.Lock()


def _saver_for(queue: AsyncCallsQueue, options: SaveOptions | None = None) -> Saver:
    """The saver of ``queue`` for ``options`` (default ``SaveOptions()``), made at first use."""
    options = options if options is not None else SaveOptions()
    with _module_lock:
        by_options = _savers.get(queue)
        if by_options is None:
            by_options = _savers[queue] = {}
        saver = by_options.get(options)
        if saver is None:
            saver = by_options[options] = Saver(queue, options)
            weakref.finalize(queue, saver.release)  # free the staging buffers with the queue
        return saver


def default_calls_queue(process_group: Any = None) -> AsyncCallsQueue:
    """The queue behind ``asyncckpt.save(..., async_op=True)`` for ``process_group``.

    One per process group: a persistent worker (started without re-importing the main
    script) and a background finalizer. Close it with ``close()`` to commit the
    pending saves and stop the worker (every rank; a later ``save`` makes a new one),
    or ``close(abort=True)`` to drop them.
    """
    with _module_lock:
        hit = _default_queues.get(id(process_group))
        if hit is not None and hit[0] is process_group and not hit[1].closed:
            return hit[1]
        queue = AsyncCallsQueue(
            persistent=True, process_group=process_group, import_main=False, background_finalize=True
        )
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
    overlap_staging: bool | None = None,
    callback: SaveCallback | None = None,
    options: SaveOptions | None = None,
    step: int | None = None,
) -> SaveHandle:
    """Save ``state_dict`` as a torch.distributed.checkpoint directory, atomically.

    Collective: every rank of ``process_group`` calls it with its own state_dict.

    Args:
        state_dict: nested dicts / lists of tensors (CPU or CUDA, any dtype, DTensor
            included: each rank stages and writes only its local shards) and
            picklable Python values.
        checkpoint_dir: the directory to create; must not exist (or be empty).
        async_op: ``False``: write and commit before returning. ``True``: stage (copy
            into reused host buffers) and return; the write and the commit run in the
            background (the handle settles by itself). Mutating the state after
            return never changes the checkpoint.
        calls_queue: the queue that runs the write (default:
            :func:`default_calls_queue` of ``process_group``).
        process_group: the ranks saving together (default: the default group, or a
            single process without ``torch.distributed``).
        coordinator_rank: the rank (in ``process_group``) that commits.
        overlap_staging: shorthand for ``options.overlap_staging``.
        callback: called once, in this process, after finalize, with the
            :class:`SaveResult` (committed) or the exception (failed); in the queue's
            finalizer thread for ``async_op=True`` (it must be thread-safe). If it
            raises, the error is logged and raised as :class:`CallbackError` by the
            next ``wait`` (the queue and the checkpoint are unaffected).
        options: staging and writing options (:class:`SaveOptions`; default
            ``SaveOptions()``). They apply to this call only: the saves of one queue
            with equal options share their staging buffers, copy threads and plan
            cache; a call with other options gets its own, and never changes what
            a call with the first options gets.
        step: the training step this state belongs to (a non-negative int), recorded
            in the manifest (``asyncckpt ls`` shows it) and in error messages;
            ``None`` (default): none.

    Returns:
        A :class:`SaveHandle`; for ``async_op=False`` it is already committed.

    Raises:
        CheckpointError: invalid input or target on any rank (raised on every rank,
            before anything is written).
        CheckpointException: (``async_op=False``) the write or commit failed on some
            rank; nothing was committed.
        InvalidArgumentError: (a ``ValueError`` and ``TypeError``) ``state_dict`` is not
            a dict, ``checkpoint_dir`` not a path, ``step`` not a non-negative int;
            ``overlap_staging`` without ``async_op``; both ``options`` and
            ``overlap_staging``; a bad ``SaveOptions`` value.
    """
    hint = "; the call is save(state_dict, checkpoint_dir)"
    check_state_dict(state_dict, hint=hint)
    check_path(checkpoint_dir, hint=hint)
    if step is not None:
        step = check_step(step)
    opts = SaveOptions.resolve(options, overlap_staging=overlap_staging)
    if opts.overlap_staging and not async_op:
        raise InvalidArgumentError("overlap_staging needs async_op=True")
    queue = calls_queue if calls_queue is not None else default_calls_queue(process_group)
    saver = _saver_for(queue, opts)
    with _module_lock:
        others = [other for other in _savers.get(queue, {}).values() if other is not saver]
    for other in others:  # an earlier overlapped save on this queue is scheduled first, whatever its options
        with other.lock:
            other.synchronize_staging()
    with saver.lock:
        return saver.save(
            state_dict,
            checkpoint_dir,
            async_op=async_op,
            process_group=process_group,
            coordinator_rank=coordinator_rank,
            callback=callback,
            step=step,
        )
