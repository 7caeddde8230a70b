"""The free function asyncckpt.save() and the default queue per process group."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from asyncckpt._check import check_callback, check_path, check_state_dict, check_step, check_step_info
from asyncckpt._gc import gc_paused
from asyncckpt.async_utils.calls_queue import AsyncCallsQueue
from asyncckpt.errors import InvalidArgumentError
from asyncckpt.options import SaveOptions
from asyncckpt.saving.handle import SaveCallback, SaveHandle
from asyncckpt.saving.saver import Saver

_log = logging.getLogger("asyncckpt")

# ====================================================================== free functions
#: The savers of each queue, one per distinct SaveOptions used for asynchronous saves: a
#: call's options= decide which saver runs it and never change another saver's (its
#: staging buffers, copy threads and plan cache stay those of its options). Only the
#: saver used last keeps its staging buffers and copy threads while idle (see save()).
_savers: weakref.WeakKeyDictionary[AsyncCallsQueue, dict[SaveOptions, Saver]] = weakref.WeakKeyDictionary()
#: id(process_group) -> (pid, incarnation, queue): the default queue belongs to this
#: process and to this incarnation of the group (see default_calls_queue).
_default_queues: dict[int, tuple[int, Any, AsyncCallsQueue]] = {}
#: Default queues of an earlier incarnation with calls still pending: never used again,
#: closed by the first default_calls_queue() that finds them idle (their pending saves
#: settle on their own), at the latest at exit.
_retired: list[AsyncCallsQueue] = []
#: (in a child of os.fork()) the parent's default queues: kept referenced, never used
#: (collecting one here could wait on a lock a thread of the parent held at the fork).
_inherited: list[AsyncCallsQueue] = []
_module_lock = threading.Lock()


def _forget_in_child() -> None:
    """A child of ``os.fork()``: the parent's queues and savers are not its own (their
    workers and buffers are the parent's; :meth:`Saver.release` does nothing here)."""
    global _module_lock
    _module_lock = threading.Lock()  # another thread of the parent may have held it
    _inherited.extend(queue for _, _, queue in _default_queues.values())
    _inherited.extend(_retired)
    _default_queues.clear()
    _retired.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _saver_for_locked(queue: AsyncCallsQueue, by_options: dict[SaveOptions, Saver], options: SaveOptions) -> Saver:
    """(holding ``_module_lock``) The saver of ``queue`` for ``options``, made at first use;
    ``by_options`` is ``_savers.get(queue, {})``."""
    saver = by_options.get(options)
    if saver is None:
        if queue not in _savers:
            _savers[queue] = by_options
        saver = by_options[options] = Saver(queue, options)
        weakref.finalize(queue, saver.release)  # free the staging buffers with the queue
    return saver


def _incarnation(process_group: Any) -> Any:
    """What identifies the current incarnation of ``process_group``: the group itself,
    or for ``None`` the default group's object (a new one after ``destroy_process_group()``
    and ``init_process_group()``), or ``None`` without ``torch.distributed``."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _live(group: Any) -> bool:
    """Whether ``group`` is a process group of the current ``torch.distributed`` state."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def _retire(queue: AsyncCallsQueue) -> None:
    """Close a default queue of an earlier incarnation of its group once nothing is
    pending on it (no collective: its finalizer's group is gone); until then keep it."""
    if queue.closed:
        return
    if queue.get_num_unfinalized_calls():
        if queue not in _retired:
            _retired.append(queue)
        return
    try:
        queue.close()
    except Exception as exc:  # noqa: BLE001 - an old queue's failure must not fail a new save
        _log.warning("asyncckpt: closing the default queue of a destroyed process group failed: %s", exc)
    for saver in _savers.pop(queue, {}).values():
        saver.release()


def default_calls_queue(process_group: Any = None) -> AsyncCallsQueue:
    """The queue behind ``asyncckpt.save(..., async_op=True)`` for ``process_group``.

    One per process group: a persistent worker (started without re-importing the main
    script) and a background finalizer. Close it with ``close()`` to commit the
    pending saves and stop the worker (every rank; a later ``save`` makes a new one),
    or ``close(abort=True)`` to drop them.

    The queue belongs to this process and to this incarnation of the group: a child of
    ``os.fork()`` (e.g. a fork-started ``multiprocessing`` process) gets its own, never
    its parent's (whose worker and finalizer are the parent's); after
    ``destroy_process_group()`` and a new ``init_process_group()`` (an in-process
    restart, as torchft and elastic agents do) the default group is a new object and
    gets a new queue, whose collectives run on the new group. The old queue is never
    used again: a later call closes it once nothing is pending on it (no collective;
    its pending saves settle on their own), at the latest the exit stops its worker.
    """
    incarnation = _incarnation(process_group)
    pid = os.getpid()
    current: AsyncCallsQueue | None = None
    idle: list[AsyncCallsQueue] = []
    with _module_lock:
        hit = _default_queues.get(id(process_group))
        if hit is not None and hit[0] == pid and hit[1] is incarnation and not hit[2].closed:
            current = hit[2]
            if _retired:  # the steady state: nothing to look at
                idle = [queue for queue in _retired if not queue.get_num_unfinalized_calls()]
                for queue in idle:
                    _retired.remove(queue)
    if current is not None:
        for old in idle:
            _retire(old)
        return current
    with _module_lock:
        hit = _default_queues.get(id(process_group))
        if hit is not None and hit[0] == pid and hit[1] is incarnation and not hit[2].closed:
            return hit[2]  # made by another thread meanwhile
        stale = [hit[2]] if hit is not None and hit[0] == pid else []
        for key, (_, old_incarnation, old) in list(_default_queues.items()):
            if key != id(process_group) and old_incarnation is not None and not _live(old_incarnation):
                del _default_queues[key]  # a group destroyed since: its queue is never used again
                stale.append(old)
        stale += [queue for queue in _retired if queue not in stale]
        _retired.clear()
        queue = AsyncCallsQueue(
            persistent=True, process_group=process_group, import_main=False, background_finalize=True
        )
        _default_queues[id(process_group)] = (pid, incarnation, queue)
    for old in stale:
        _retire(old)
    return queue


@gc_paused()
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
    metrics: Mapping[str, float] | None = None,
    metadata: dict[str, Any] | None = None,
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
            ``SaveOptions()``). They apply to this call only: the asynchronous saves
            of one queue with equal options share their staging buffers, copy threads
            and plan cache; a call with other options gets its own, and never changes
            what a call with the first options gets. Memory held: an asynchronous
            save frees the idle staging buffers of the queue's other options (one
            set of idle buffers per queue); a synchronous save uses its options'
            buffer if asynchronous saves keep one, else a buffer and copy threads of
            its own, released when it returns.
        step: the training step this state belongs to (a non-negative int), recorded
            in the manifest (``asyncckpt ls`` shows it) and in error messages;
            ``None`` (default): none.
        metrics: numbers by name (``{"val_loss": 0.31}``) stored in the manifest
            (the coordinator's); read back by :func:`asyncckpt.read_metadata` without
            reading any tensor, ranked by ``BestN``.
        metadata: a JSON-serializable ``dict`` with ``str`` keys stored the same way
            (the coordinator's).

    Returns:
        A :class:`SaveHandle`; for ``async_op=False`` it is already committed.

    Raises:
        CheckpointError: invalid input or target on any rank (raised on every rank,
            before anything is written).
        CheckpointException: (``async_op=False``) the write or commit failed on some
            rank; nothing was committed.
        InvalidArgumentError: (a ``ValueError`` and ``TypeError``) ``state_dict`` is not
            a dict, ``checkpoint_dir`` not a path, ``step`` not a non-negative int,
            ``callback`` not callable, ``metrics`` / ``metadata`` of the wrong shape
            (nothing is staged); ``overlap_staging`` without ``async_op``; both
            ``options`` and ``overlap_staging``; a bad ``SaveOptions`` value.
    """
    hint = "; the call is save(state_dict, checkpoint_dir)"
    check_state_dict(state_dict, hint=hint)
    check_path(checkpoint_dir, hint=hint)
    if step is not None:
        step = check_step(step)
    check_callback(callback)
    user_info = check_step_info(metrics, metadata)
    opts = SaveOptions.resolve(options, overlap_staging=overlap_staging)
    if opts.overlap_staging and not async_op:
        raise InvalidArgumentError("overlap_staging needs async_op=True")
    queue = calls_queue if calls_queue is not None else default_calls_queue(process_group)
    with _module_lock:
        kept = _savers.get(queue, {})
        # A synchronous save uses the saver its options keep for asynchronous saves (its
        # buffer is there already), else a saver of its own, released when it returns.
        saver = _saver_for_locked(queue, kept, opts) if async_op else kept.get(opts)
        others = [other for other in kept.values() if other is not saver]
    transient = saver is None
    if saver is None:
        saver = Saver(queue, opts)
    for other in others:
        with other.lock:
            if async_op and not other.busy():
                other.free_idle_buffers()  # one set of idle staging buffers per queue: the options used last
    try:
        with saver.lock:
            return saver.save(
                state_dict,
                checkpoint_dir,
                async_op=async_op,
                process_group=process_group,
                coordinator_rank=coordinator_rank,
                callback=callback,
                step=step,
                user_info=user_info,
            )
    finally:
        if transient:
            saver.release()  # its staging buffer and copy threads go now, not with the queue
